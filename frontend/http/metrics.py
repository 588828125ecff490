"""``/metrics`` in the Prometheus text format. Latencies are measured here, in the frontend, as
tokens reach it (``RequestObserver``); everything else is the scheduler's stats, the same numbers
a ZMQ client gets from ``GetStats``, fetched when /metrics is scraped."""

from __future__ import annotations

import time
from typing import Iterator, NamedTuple

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.25, 2.5, 5.0, 10.0, 20.0,
                    40.0, 80.0)


class Stat(NamedTuple):
    name: str  # without the sluice_ prefix (and, for counters, the _total suffix)
    counter: bool
    doc: str
    keys: tuple[tuple[str, str], ...]  # (label value, scheduler stat key); label "" = no label
    label: str = ""


STATS = (
    Stat("prompt_tokens", True, "Prompt tokens of finished requests", (("", "prompt_tokens"),)),
    Stat("cached_prompt_tokens", True, "Prompt tokens served from the prefix cache",
         (("", "cached_prompt_tokens"),)),
    Stat("generated_tokens", True, "Tokens sampled", (("", "generated_tokens"),)),
    Stat("requests_finished", True, "Requests that finished", (("", "requests_finished"),)),
    Stat("requests_aborted", True, "Requests aborted", (("", "requests_aborted"),)),
    Stat("requests_preempted", True, "Requests preempted", (("", "requests_preempted"),)),
    Stat("frontend_requests", True, "Generate requests received, both doors",
         (("", "frontend_requests_total"),)),
    Stat("frontend_errors", True, "Error replies sent", (("", "frontend_errors_total"),)),
    Stat("client_disconnects", True, "ZMQ clients found gone",
         (("", "frontend_client_disconnects_total"),)),
    Stat("prompt_tokens_reused", True, "Chat prompt tokens the frontend took from kept pieces or harmony "
         "messages instead of tokenizing them again (an agent's history)", (("", "frontend_prompt_tokens_reused"),)),
    Stat("prompt_pieces_kept_tokens", False, "Tokens of the chat-prompt pieces and harmony messages the "
         "frontend keeps", (("", "frontend_prompt_pieces_kept_tokens"),)),
    Stat("requests_running", False, "Requests running", (("", "requests_running"),)),
    Stat("requests_waiting", False, "Requests waiting", (("", "requests_waiting"),)),
    Stat("kv_usage_ratio", False, "Share of KV pages in use", (("gpu", "kv_usage"),
                                                              ("host", "kv_host_usage")), "tier"),
    Stat("expert_cache_hit_rate", False, "GPU expert-cache hit rate since start",
         (("", "moe_hit_rate"),)),
    Stat("pcie_bytes", True, "Bytes moved over PCIe", (
        ("expert_miss_h2d", "moe_bytes_h2d"), ("prefill_stream_h2d", "prefill_bytes_h2d"),
        ("kv_write_d2h", "kv_host_bytes_written"), ("kv_restore_h2d", "kv_host_bytes_restored")),
        "kind"),
    Stat("prefill_pipeline_chunks", True, "Prefill chunks through the expert pipeline", (
        ("kernel", "prefill_chunks_kernel"), ("memcpy", "prefill_chunks_memcpy"),
        ("misses", "prefill_chunks_misses"), ("mirror", "prefill_chunks_mirror")), "stage"),
    Stat("prefill_mirror_errors", True, "Experts the host's mirror of the expert cache got wrong in prefill "
         "staging: copied though resident, or repaired by a gather", (("wasted", "prefill_mirror_wasted"),
                                                                      ("repaired", "prefill_mirror_repaired")),
         "kind"),
    Stat("engine_seconds", True, "Scheduler time in engine steps: host work, and waiting for a step's tokens "
         "(under overlap scheduling, a wait near zero says the host bounds the loop)",
         (("host", "engine_host_s"), ("gpu_wait", "engine_gpu_wait_s")), "kind"),
    Stat("engine_prefill_launch_seconds", True, "Of the engine's host work, enqueueing steps that carry a "
         "prefill chunk (before a prompt's first token can come)", (("", "engine_prefill_launch_s"),)),
    Stat("compilations_after_warmup", True, "Kernels compiled and attention plans built while serving, after "
         "the warm-up (each a slow step)", (("triton", "compiles_after_warmup"), ("cudnn_plan", "plans_after_warmup")),
         "kind"),
    # hybrid models: the linear layers' state snapshots in the prefix cache (scheduler/state_cache.py)
    Stat("state_prompt_tokens", True, "Prompt tokens whose linear-layer state came from a snapshot, or was "
         "computed again though their KV was cached", (("resumed", "state_prefix_tokens"),
                                                      ("recomputed", "state_recomputed_tokens")), "kind"),
    Stat("state_snapshots", False, "Recurrent-state snapshots held", (("gpu", "state_snapshots_gpu"),
                                                                     ("host", "state_snapshots_host")), "tier"),
    Stat("state_snapshot_bytes", False, "Bytes of the recurrent-state snapshots held", (
        ("gpu", "state_snapshot_bytes_gpu"), ("host", "state_snapshot_bytes_host")), "tier"),
)

# One series per rank of an expert-parallel run (``--gpus N``), from the scheduler's
# ``rank{r}.{key}`` stats; the totals above stay rank 0's counters, as with one GPU.
RANK_STATS = (
    Stat("rank_expert_cache_hit_rate", False, "GPU expert-cache hit rate of one rank since start",
         (("", "moe_hit_rate"),)),
    Stat("rank_expert_lookups", True, "Routed experts one rank looked up in its cache", (("", "moe_lookups"),)),
    Stat("rank_pcie_bytes", True, "Bytes one rank moved over PCIe for its experts", (
        ("expert_miss_h2d", "moe_bytes_h2d"), ("prefill_stream_h2d", "prefill_bytes_h2d")), "kind"),
    Stat("rank_all_reduce_seconds", True, "Host time of one rank's expert all_reduces (CPU runs only)",
         (("", "all_reduce_s"),)),
)


class _SchedulerStats:
    """A collector over the latest stats snapshot; a stat the scheduler does not report (no
    expert cache, no host tier) is left out rather than shown as 0."""

    def __init__(self) -> None:
        self.stats: dict = {}

    def collect(self) -> Iterator[Metric]:
        for stat in STATS:
            yield from self._family(stat)
        for stat in RANK_STATS:
            yield from self._family(stat, "rank", [str(r) for r in range(int(self.stats.get("ranks", 0)))])

    def _family(self, stat: Stat, group_label: str = "", groups: tuple | list = ("",)) -> Iterator[Metric]:
        """``stat``'s family: a series per key and per group (a rank: its keys ``rank{r}.{key}``),
        none at all if the scheduler reports none of its keys."""
        found = [([group] * bool(group_label) + [label] * bool(stat.label), self.stats[name])
                 for group in groups for label, key in stat.keys
                 for name in [f"{group_label}{group}.{key}" if group_label else key]
                 if isinstance(self.stats.get(name), (int, float))]
        if not found:
            return
        kind = CounterMetricFamily if stat.counter else GaugeMetricFamily
        family = kind(f"sluice_{stat.name}", stat.doc, labels=[n for n in (group_label, stat.label) if n])
        for labels, value in found:
            family.add_metric(labels, float(value))
        yield family


class Metrics:
    def __init__(self) -> None:
        self.started = int(time.time())
        self.registry = CollectorRegistry()
        self.ttft = Histogram("sluice_time_to_first_token_seconds",
                              "Time from a request's arrival to its first token",
                              buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.itl = Histogram("sluice_inter_token_latency_seconds",
                             "Time between a request's tokens", buckets=_LATENCY_BUCKETS,
                             registry=self.registry)
        self._scheduler = _SchedulerStats()
        self.registry.register(self._scheduler)

    def on_tokens(self, started_s: float, previous_s: float | None, now_s: float, count: int) -> None:
        if previous_s is None:
            self.ttft.observe(now_s - started_s)
            return  # tokens that arrive with the first are not spaced by any latency
        gap = (now_s - previous_s) / count
        for _ in range(count):
            self.itl.observe(gap)

    def render(self, scheduler_stats: dict) -> tuple[bytes, str]:
        self._scheduler.stats = scheduler_stats
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
