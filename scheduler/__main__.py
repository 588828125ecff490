"""``python -m scheduler``: the scheduler process (normally spawned by the frontend)."""
from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import sys

from scheduler.cli_options import engine_parser, scheduler_config

REMOVE_ON_EXIT_ENV = "SLUICE_REMOVE_ON_EXIT"  # set by frontend.launch: its socket dir and pid file


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m scheduler", description=__doc__, parents=[engine_parser()],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter, allow_abbrev=False)
    launch = p.add_argument_group("launch", "set by the frontend that spawns this process")
    launch.add_argument("--frontend-to-scheduler", required=True, metavar="ENDPOINT",
                        help="ZMQ endpoint to PULL requests from")
    launch.add_argument("--scheduler-to-frontend", required=True, metavar="ENDPOINT",
                        help="ZMQ endpoint to PUSH outputs to")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s scheduler %(levelname)s %(message)s")
    args = parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the frontend stops us with Shutdown or SIGTERM
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # also sent when the frontend dies
    try:
        try:
            config = scheduler_config(args)
        except ValueError as err:  # options that cannot go together: one line, before torch loads
            print(f"error: {err}", file=sys.stderr)
            return 2
        from scheduler.process import serve  # torch loads here: --help and refused options answer at once

        return serve(config, args.frontend_to_scheduler, args.scheduler_to_frontend)
    finally:
        _remove_frontend_files()


def _remove_frontend_files() -> None:
    """The frontend removes its socket dir and pid file when it stops; when it died instead, this
    is the process left to do it (a stale pid file would point py-spy at a dead process). The
    SIGTERM that the kernel sends when the frontend dies may land while this runs: ignored from
    here, so its SystemExit cannot cut the removal short."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    for path in filter(None, os.environ.get(REMOVE_ON_EXIT_ENV, "").split(os.pathsep)):
        if os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        elif os.path.exists(path):
            os.unlink(path)


if __name__ == "__main__":
    sys.exit(main())
