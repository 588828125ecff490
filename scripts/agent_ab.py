"""A/B of two server builds on the growing agent session, through the real server and client.

    python scripts/agent_ab.py [--serve "OPTIONS FOR BOTH"] [--a "OPTIONS"] [--b "OPTIONS"]
        [--a-root DIR] [--b-root DIR] [--rounds 1] [--builds AB|A|B] [--sessions 1] [--turns 120]
        [--context 4000] [--tool-tokens 1000] [--max-tokens 64] [--content fresh|shared] [--seed 0]
        [--text [--http]] [--json agent_ab.json] [--png agent_ab.png | --no-plot]
    python scripts/agent_ab.py --merge a.json b.json [--json ab.json] [--png ab.png]

For each build (A: the defaults, B: ``--prefill-invalidate eager`` unless told otherwise; each may
be another checkout) it starts that checkout's ``scripts/serve.sh``, waits for it, warms it up with
a short session of its own, runs the workload of ``scripts/agent_sessions.py``, reads the server's
stats, and stops it; then the other build. ``--rounds 2`` runs A, B, A, B, which spreads machine
noise over both; ``--builds A`` and ``--builds B`` in two commands, then ``--merge a.json b.json``,
give the same report. Out: a JSON file with every turn of every run, a PNG of turn time and TTFT against
the context, and a side-by-side table (turns over ``--slow-turn`` seconds, worst turn, p50 / p99,
cached / ideal tokens, expert-cache hit rate, host KV pages restored).
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import queue
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout, uninstalled

from scripts import ab_report  # noqa: E402
from scripts.agent_sessions import (  # noqa: E402
    Workload, add_workload_args, connect, run_sessions, server_stats, session, workload_from_args,
)

DEFAULT_B = "--prefill-invalidate eager"


class Build(NamedTuple):
    label: str
    root: Path  # the checkout whose scripts/serve.sh runs
    options: tuple[str, ...]  # engine options of this build, after the common ones

    def command(self, common: tuple[str, ...], pid_file: Path, http: bool = False) -> list[str]:
        # over ZMQ no HTTP port, which another server on the machine may hold; with --http any free one
        api = ["--http-port", "0"] if http else ["--no-http"]
        return [str(self.root / "scripts" / "serve.sh"), "--endpoint", "tcp://127.0.0.1:*",
                "--pid-file", str(pid_file), *api, *common, *self.options]


class Server(NamedTuple):
    proc: subprocess.Popen
    endpoint: str
    log: Path
    http: str | None = None  # the OpenAI API's URL, when it serves one


def _read_lines(stream, lines: queue.Queue) -> None:
    for line in stream:
        lines.put(line)
    lines.put(None)  # EOF: the server exited


def start_server(command: list[str], log: Path, timeout_s: float, http: bool = False) -> Server:
    """Start serve.sh and wait for its ``frontend endpoint`` line (the scheduler is ready then), and
    with ``http`` for its ``http endpoint`` line too."""
    proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log.open("w"),
                            text=True, start_new_session=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=_read_lines, args=(proc.stdout, lines), daemon=True).start()
    deadline = time.monotonic() + timeout_s
    wanted, found = ("frontend", "http") if http else ("frontend",), {}
    while True:
        try:
            line = lines.get(timeout=max(deadline - time.monotonic(), 0.01))
        except queue.Empty:
            proc.kill()
            raise RuntimeError(f"the server was not ready within {timeout_s:g} s; its log: {log}") from None
        if line is None:
            raise RuntimeError(f"the server exited with code {proc.wait()} before it was ready; "
                               f"last lines of {log}:\n{_tail(log)}")
        name, _, rest = line.partition(" endpoint ")
        if rest and name in wanted:
            found[name] = rest.strip()
        if len(found) == len(wanted):
            return Server(proc, found["frontend"], log, found.get("http"))


def stop_server(server: Server, timeout_s: float = 60.0) -> int:
    """SIGTERM: the frontend shuts the scheduler down through the protocol; kill if it hangs."""
    if server.proc.poll() is None:
        server.proc.send_signal(signal.SIGTERM)
    try:
        return server.proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(server.proc.pid, signal.SIGKILL)
        return server.proc.wait()


def _tail(log: Path, lines: int = 30) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


def run_build(build: Build, rnd: int, args: argparse.Namespace, workload: Workload, log_dir: Path) -> dict:
    """One run: start the build's server, warm it up, measure the workload, stop it."""
    log = log_dir / f"{build.label}-{rnd}.log"
    command = build.command(tuple(shlex.split(args.serve)), log_dir / f"{build.label}-{rnd}.pid", args.http)
    print(f"[{build.label} round {rnd}] {shlex.join(command)}", file=sys.stderr, flush=True)
    started = time.perf_counter()
    server = start_server(command, log, args.ready_timeout, args.http)
    ready_s = time.perf_counter() - started
    try:
        warmup = dataclasses.replace(workload, sessions=1, turns=args.warmup_turns, content="fresh")
        warm = asyncio.run(_warmup(server, warmup, args.turn_timeout))
        before = asyncio.run(server_stats(server.endpoint, args.turn_timeout))
        turns = asyncio.run(run_sessions(server.endpoint, workload, args.turn_timeout,
                                         on_turn=lambda row: _print_turn(build.label, rnd, row), http=server.http))
        after = asyncio.run(server_stats(server.endpoint, args.turn_timeout))
    except BaseException:
        stop_server(server)
        print(f"the run failed; last lines of {log}:\n{_tail(log)}", file=sys.stderr)
        raise
    code = stop_server(server)
    if code != 0:
        raise RuntimeError(f"the server of build {build.label} exited with code {code}; see {log}")
    return dict(build=build.label, round=rnd, command=command, ready_s=ready_s, warmup=warm, turns=turns,
                stats_before=before, stats_after=after, log=str(log))


def _print_turn(label: str, rnd: int, row: dict) -> None:
    """One line a turn on stderr: a run cut short (a time limit) still leaves what it measured."""
    print(f"[{label} round {rnd}] session {row['session']} turn {row['turn']}: prompt {row['prompt_tokens']}, "
          f"cached {row['cached_tokens']}, TTFT {row['ttft_s']:.3f} s, turn {row['seconds']:.3f} s",
          file=sys.stderr, flush=True)


async def _warmup(server: Server, warmup: Workload, timeout: float) -> list[dict]:
    """A session of its own content (session -1 shares no prefix with the measured ones) that
    compiles the kernels before the clock runs: the first turn of a cold server is not the A/B."""
    if warmup.turns == 0:
        return []
    async with connect(server.endpoint, timeout, server.http) as client:
        return await session(client, -1, warmup, time.perf_counter())


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    # a value that is one bare flag needs the = form (--a=--no-cuda-graph): argparse takes it for an option
    p.add_argument("--serve", default="", help="serve.sh options of both builds (model, cache, memory limit)")
    p.add_argument("--a", default="", help="serve.sh options of build A (default: none, the defaults)")
    p.add_argument("--b", default=DEFAULT_B, help=f"serve.sh options of build B (default: {DEFAULT_B})")
    p.add_argument("--a-root", type=Path, default=ROOT, help="checkout that serves build A (default: this one)")
    p.add_argument("--b-root", type=Path, default=ROOT, help="checkout that serves build B (default: this one)")
    p.add_argument("--rounds", type=int, default=1, help="runs per build, interleaved: A, B, A, B, ...")
    p.add_argument("--builds", default="AB", choices=["AB", "A", "B"],
                   help="which builds to run (one per command, then --merge, where a command's time is limited)")
    p.add_argument("--merge", nargs="+", metavar="JSON", help="run nothing: report on these earlier outputs together")
    # one session growing past 130k tokens in 120 turns: 4000 + 119 x (1000 + 64)
    add_workload_args(p, sessions=1, turns=120, context=4000, tool_tokens=1000, max_tokens=64)
    p.add_argument("--http", action="store_true",
                   help="the turns go to each server's OpenAI API by the openai client (needs --text; "
                        "scripts/agent_sessions.py --http)")
    p.add_argument("--warmup-turns", type=int, default=2, help="turns of the unmeasured warm-up session (0: none)")
    p.add_argument("--slow-turn", dest="slow_turn_s", type=float, default=10.0, help="seconds that make a turn slow")
    p.add_argument("--ready-timeout", type=float, default=1800.0, help="seconds a server may take to start")
    p.add_argument("--turn-timeout", type=float, default=600.0, help="seconds a turn may wait for a reply")
    p.add_argument("--log-dir", type=Path, default=None, help="server logs (default: a temporary directory)")
    p.add_argument("--json", default="agent_ab.json", help="every turn of every run, and the summaries")
    p.add_argument("--png", default="agent_ab.png", help="the plot")
    p.add_argument("--no-plot", action="store_true", help="write no PNG (matplotlib not needed)")
    args = p.parse_args(argv)
    if args.http and not args.text:
        p.error("--http sends chat messages: add --text")
    return args


def _check_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        sys.exit("error: the plot needs matplotlib, which is not installed: pip install matplotlib "
                 "(or the project's 'bench' extra: pip install -e '.[bench]'), or pass --no-plot")


def measure(args: argparse.Namespace) -> dict:
    """Run the builds of ``--builds``, ``--rounds`` times each, interleaved."""
    workload = workload_from_args(args)
    builds = [b for b in (Build("A", args.a_root.resolve(), tuple(shlex.split(args.a))),
                          Build("B", args.b_root.resolve(), tuple(shlex.split(args.b)))) if b.label in args.builds]
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="agent-ab-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    print(f"server logs: {log_dir}", file=sys.stderr)
    result = dict(serve=shlex.split(args.serve), workload=dataclasses.asdict(workload),
                  builds=[dict(label=b.label, root=str(b.root), options=list(b.options)) for b in builds], runs=[])
    for rnd in range(args.rounds):
        for build in builds:
            result["runs"].append(run_build(build, rnd, args, workload, log_dir))
            Path(args.json).write_text(json.dumps(result, indent=1))  # the runs so far survive a later failure
    return result


def merge(paths: list[str]) -> dict:
    """Earlier outputs as one result (e.g. A and B measured by separate commands)."""
    parts = [json.loads(Path(p).read_text()) for p in paths]
    builds = {b["label"]: b for part in parts for b in part["builds"]}
    return dict(serve=parts[0]["serve"], workload=parts[0]["workload"], builds=[builds[k] for k in sorted(builds)],
                runs=[r for part in parts for r in part["runs"]])


def report(result: dict, args: argparse.Namespace) -> None:
    builds, runs = result["builds"], result["runs"]
    result["slow_turn_s"] = args.slow_turn_s
    result["summary"] = {b["label"]: ab_report.summarise_build([r for r in runs if r["build"] == b["label"]],
                                                               args.slow_turn_s) for b in builds}
    Path(args.json).write_text(json.dumps(result, indent=1))
    if not args.no_plot:
        w = result["workload"]
        title = (f"{' '.join(result['serve']) or 'serve.sh defaults'}; {w['sessions']} session(s) x {w['turns']} "
                 f"turns, +{w['tool_tokens']} tool / {w['max_tokens']} answer tokens a turn")
        ab_report.plot(args.png, builds, runs, args.slow_turn_s, title)
    print(ab_report.table(builds, result["summary"], args.slow_turn_s))
    print(f"every turn: {args.json}" + ("" if args.no_plot else f"; plot: {args.png}"))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.no_plot:
        _check_matplotlib()
    report(merge(args.merge) if args.merge else measure(args), args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
