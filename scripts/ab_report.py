"""The report of ``scripts/agent_ab.py``: per build, the summary of every turn of its runs, the
side-by-side table, and the plot of turn time and TTFT against the context length."""
from __future__ import annotations

import math
import textwrap

import numpy as np

COLORS = ("tab:blue", "tab:orange", "tab:green", "tab:red")


def _delta(run: dict, key: str) -> float | None:
    """How much a server counter grew over the measured turns; None when the server has no such counter."""
    before, after = run["stats_before"], run["stats_after"]
    if key not in after:
        return None
    return after[key] - before.get(key, 0)


def _sum_deltas(runs: list[dict], key: str) -> float | None:
    deltas = [_delta(r, key) for r in runs]
    return None if any(d is None for d in deltas) else sum(deltas)


def _percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else math.nan


def decode_ms(turns: list[dict]) -> tuple[float, float]:
    """Milliseconds a decoded token (the turn minus its TTFT, over the tokens after the first): the
    median of the tenth of the turns with the shortest prompts, and of the tenth with the longest. A
    decode that slows with the context shows as the second far above the first (the hybrid's served
    session once read 5.9 / 20.5 ms: a host walk of the prefix cache at each request's end)."""
    per = sorted((t["prompt_tokens"], 1e3 * (t["seconds"] - t["ttft_s"]) / (t["new_tokens"] - 1))
                 for t in turns if t.get("ttft_s") is not None and t.get("new_tokens", 0) > 1)
    k = max(len(per) // 10, 1)
    return _percentile([ms for _, ms in per[:k]], 50), _percentile([ms for _, ms in per[-k:]], 50)


def summarise_build(runs: list[dict], slow_s: float) -> dict:
    """One build's figures over every turn of all its runs (rounds)."""
    turns = [t for r in runs for t in r["turns"]]
    later = [t for t in turns if t["turn"] > 0]
    seconds = [t["seconds"] for t in turns]
    ttft = [t["ttft_s"] for t in turns if t["ttft_s"] is not None]
    ideal = sum(t["ideal_cached"] for t in later)
    hits, lookups = _sum_deltas(runs, "moe_hits"), _sum_deltas(runs, "moe_lookups")
    decode_short, decode_long = decode_ms(turns)
    return dict(
        runs=len(runs), turns=len(turns), turns_over_slow=sum(s > slow_s for s in seconds),
        worst_turn_s=max(seconds, default=math.nan), max_context_tokens=max((t["prompt_tokens"] for t in turns), default=0),
        ttft_p50_s=_percentile(ttft, 50), ttft_p99_s=_percentile(ttft, 99),
        turn_p50_s=_percentile(seconds, 50), turn_p99_s=_percentile(seconds, 99),
        decode_ms_short=decode_short, decode_ms_long=decode_long,
        cached_tokens=sum(t["cached_tokens"] for t in later), ideal_cached_tokens=ideal,
        cached_ratio=sum(t["cached_tokens"] for t in later) / ideal if ideal else math.nan,
        expert_hit_rate=hits / lookups if hits is not None and lookups else None,
        kv_host_pages_restored=_sum_deltas(runs, "kv_host_pages_restored"),
        compiles_after_warmup=_sum_deltas(runs, "compiles_after_warmup"),
        plans_after_warmup=_sum_deltas(runs, "plans_after_warmup"),
        engine_host_s=_sum_deltas(runs, "engine_host_s"), engine_gpu_wait_s=_sum_deltas(runs, "engine_gpu_wait_s"),
        engine_prefill_launch_s=_sum_deltas(runs, "engine_prefill_launch_s"),
    )


def _fmt(value, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return "nan" if math.isnan(value) else f"{value:.{digits}f}"
    return str(value)


def table(builds: list[dict], summaries: dict[str, dict], slow_s: float) -> str:
    """The side-by-side table, one column per build."""
    labels = [b["label"] for b in builds]
    s = [summaries[label] for label in labels]
    rows = [
        ("options", [" ".join(b["options"]) or "(defaults)" for b in builds]),
        ("runs x turns per run", [f"{x['runs']} x {x['turns'] // max(x['runs'], 1)}" for x in s]),
        ("largest context, tokens", [_fmt(x["max_context_tokens"]) for x in s]),
        (f"turns > {slow_s:g} s", [_fmt(x["turns_over_slow"]) for x in s]),
        ("worst turn, s", [_fmt(x["worst_turn_s"]) for x in s]),
        ("TTFT p50 / p99, s", [f"{_fmt(x['ttft_p50_s'])} / {_fmt(x['ttft_p99_s'])}" for x in s]),
        ("turn p50 / p99, s", [f"{_fmt(x['turn_p50_s'])} / {_fmt(x['turn_p99_s'])}" for x in s]),
        ("decode ms/token, short / long ctx", [f"{_fmt(x.get('decode_ms_short'), 1)} / "
                                               f"{_fmt(x.get('decode_ms_long'), 1)}" for x in s]),
        ("cached / ideal tokens", [f"{x['cached_tokens']} / {x['ideal_cached_tokens']} ({_fmt(x['cached_ratio'])})"
                                   for x in s]),
        ("expert-cache hit rate", [_fmt(x["expert_hit_rate"]) for x in s]),
        ("host KV pages restored", [_fmt(x["kv_host_pages_restored"]) for x in s]),
        ("compiles / plans after warm-up", [f"{_fmt(x.get('compiles_after_warmup'))} / "
                                            f"{_fmt(x.get('plans_after_warmup'))}" for x in s]),
        ("engine s: host / waiting for the GPU", [f"{_fmt(x.get('engine_host_s'), 1)} / "
                                                  f"{_fmt(x.get('engine_gpu_wait_s'), 1)}" for x in s]),
        ("engine s enqueueing prefill chunks", [_fmt(x.get("engine_prefill_launch_s"), 2) for x in s]),
    ]
    width = max(len(name) for name, _ in rows)
    cols = [max(len(label), *(len(values[i]) for _, values in rows)) for i, label in enumerate(labels)]
    lines = [" ".join([" " * width, *(label.rjust(w) for label, w in zip(labels, cols))])]
    lines += [" ".join([name.ljust(width), *(v.rjust(w) for v, w in zip(values, cols))]) for name, values in rows]
    return "\n".join(lines)


def plot(path: str, builds: list[dict], runs: list[dict], slow_s: float, title: str) -> None:
    """Turn time and TTFT against the turn's prompt tokens; one colour per build, a line per session."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 5), sharex=True)
    for color, build in zip(COLORS, builds):
        label = f"{build['label']}: {' '.join(build['options']) or '(defaults)'}"
        for run in (r for r in runs if r["build"] == build["label"]):
            for sid in sorted({t["session"] for t in run["turns"]}):
                turns = sorted((t for t in run["turns"] if t["session"] == sid), key=lambda t: t["turn"])
                x = [t["prompt_tokens"] for t in turns]
                for ax, key in zip(axes, ("seconds", "ttft_s")):
                    ax.plot(x, [t[key] for t in turns], ".-", color=color, alpha=0.6, markersize=3, label=label)
                label = None  # one legend entry per build
    worst = max((t["seconds"] for r in runs for t in r["turns"]), default=0.0)
    if worst > slow_s / 2:
        axes[0].axhline(slow_s, color="grey", linestyle="--", linewidth=1)
    for ax, name in zip(axes, ("turn time, s", "time to first token, s")):
        ax.set_xlabel("context (prompt tokens of the turn)")
        ax.set_ylabel(name)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    axes[0].legend(loc="upper left", fontsize=8)
    fig.suptitle(textwrap.fill(title, 150), fontsize=10)  # a long serve line wraps instead of leaving the figure
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
