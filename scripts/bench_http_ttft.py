"""Cold versus warm time to first token over the HTTP API, and what the warm-up adds to start-up.

Starts ``python -m frontend`` on the given model (default: qwen3-30b-geometry, dummy weights, 25 %
expert cache), then sends long prompts of fresh random token ids (no prefix-cache hit) with
``max_tokens=1`` to /v1/completions, so each request's latency is its TTFT. The first request is
the cold one; the bound it chases is the design's promise that the first request costs what later
ones do (ratio <= 1.5).

    python scripts/bench_http_ttft.py [--prompt-tokens 16384] [--warm 3] [--json FILE] [-- extra server args]
    python scripts/bench_http_ttft.py -- --no-warm-up      # the same without the warm-up, to compare

Extra server arguments follow the defaults, so a later ``--model`` or ``--moe-cache-fraction`` wins.
"""
from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

DEFAULT_SERVER = ["--model", "qwen3-30b-geometry", "--dummy-weights", "--moe-cache-fraction", "0.25"]
WARM_UP_LINE = re.compile(r"warm-up: .* in ([0-9.]+) s")


def start(args: argparse.Namespace, tmp: Path) -> tuple[subprocess.Popen, str, float, Path]:
    log = tmp / "server.log"
    cmd = [sys.executable, "-m", "frontend", "--endpoint", "tcp://127.0.0.1:*", "--http-port", "0",
           "--served-model-name", "bench",
           *DEFAULT_SERVER, *args.server]
    began = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log.open("w"), text=True)
    lines = [proc.stdout.readline() for _ in range(3)]
    if not lines[2].startswith("http endpoint"):
        sys.exit(f"the server did not start:\n{log.read_text()[-3000:]}")
    return proc, lines[2].split()[-1], time.perf_counter() - began, log


def ttft(url: str, n: int, seed: int) -> tuple[float, int]:
    gen = random.Random(seed)
    prompt = [gen.randrange(10, 250) for _ in range(n)]
    body = {"model": "bench", "prompt": prompt, "max_tokens": 1, "temperature": 0, "ignore_eos": True}
    began = time.perf_counter()
    reply = httpx.post(url + "/v1/completions", json=body, timeout=600).raise_for_status().json()
    return time.perf_counter() - began, reply["usage"]["prompt_tokens_details"]["cached_tokens"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt-tokens", type=int, default=16384)
    p.add_argument("--warm", type=int, default=3, help="warm requests after the cold one")
    p.add_argument("--json", help="write the results here")
    p.add_argument("server", nargs="*", help="server arguments after --")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        proc, url, ready_s, log = start(args, Path(tmp))
        try:
            cold, cold_cached = ttft(url, args.prompt_tokens, seed=0)
            warm = [ttft(url, args.prompt_tokens, seed=1 + i) for i in range(args.warm)]
        finally:
            proc.terminate()
            proc.wait(timeout=120)
        found = WARM_UP_LINE.findall(log.read_text())
    warm_s = statistics.median(t for t, _ in warm)
    result = {"prompt_tokens": args.prompt_tokens, "ready_s": ready_s,
              "warm_up_s": float(found[-1]) if found else None, "cold_ttft_s": cold,
              "warm_ttft_s": warm_s, "cold_over_warm": cold / warm_s,
              "cached_tokens": [cold_cached] + [c for _, c in warm], "server": DEFAULT_SERVER + args.server}
    print(f"{'start-up to ready':<22}{ready_s:8.1f} s   (of which warm-up {result['warm_up_s']} s)")
    print(f"{'cold TTFT':<22}{cold:8.2f} s")
    print(f"{'warm TTFT (median)':<22}{warm_s:8.2f} s")
    print(f"{'cold / warm':<22}{cold / warm_s:8.2f}     (bound: <= 1.5)")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
