"""List or remove Sluice expert stores (shared-memory segments under /dev/shm).

    python scripts/expert_store.py list
    python scripts/expert_store.py remove sluice-experts-0123456789abcdef
    python scripts/expert_store.py remove --all

A removed segment disappears from /dev/shm at once; its memory is freed when the last process that
maps it exits.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from moe_offload.expert_store import SHM_DIR, SegmentInfo, list_segments, remove_segment  # noqa: E402


def _describe(info: SegmentInfo) -> str:
    created = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info.created)) if info.created else "-"
    state = "complete" if info.complete else "INCOMPLETE"
    what = info.label or f"not a usable store: {info.problem}"
    return f"{info.name:32s} {info.nbytes / 1e9:9.2f} GB  {state:10s}  {created:19s}  {what}"


def cmd_list(args: argparse.Namespace) -> int:
    infos = list_segments(args.dir)
    if not infos:
        print(f"no expert stores in {args.dir}")
        return 0
    print(f"{'name':32s} {'size':>12s}  {'state':10s}  {'created':19s}  identity")
    for info in infos:
        print(_describe(info))
    total = sum(info.nbytes for info in infos)
    print(f"{len(infos)} store(s), {total / 1e9:.2f} GB")
    return 0


def cmd_remove(args: argparse.Namespace) -> int:
    names = [info.name for info in list_segments(args.dir)] if args.all else [args.name]
    for name in names:
        try:
            remove_segment(name, args.dir)
        except (ValueError, FileNotFoundError) as e:
            print(f"cannot remove {name}: {e}", file=sys.stderr)
            return 1
        print(f"removed {name}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", type=Path, default=SHM_DIR, help="where the segments live (default: %(default)s)")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("list", help="name, size, complete?, created, identity of every store").set_defaults(run=cmd_list)
    remove = commands.add_parser("remove", help="unlink one store, or all of them")
    which = remove.add_mutually_exclusive_group(required=True)
    which.add_argument("name", nargs="?", help="a store name as `list` prints it")
    which.add_argument("--all", action="store_true", help="every sluice-experts-* segment")
    remove.set_defaults(run=cmd_remove)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
