"""Which routing the model runs: its own router, the synthetic one (dummy weights), or a replayed
trace; and whether to record what it routes (``--routing``, ``--record-routing``)."""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from moe_offload.routing import ModelRouting, Routing, SyntheticRouting
from moe_offload.routing_trace import RecordingRouting, ReplayRouting, RoutingTrace
from moe_offload.synthetic_routing import SyntheticRouter
from worker.config import ModelConfig

log = logging.getLogger("sluice.worker")
ROUTINGS = ("model", "synthetic", "replay:FILE")


@dataclass(frozen=True)
class RoutingOptions:
    routing: str = "model"  # "model" | "synthetic" (needs dummy weights) | "replay:FILE"
    record: str | None = None  # trace file written at exit
    record_tokens: int = 65536  # tokens the record holds (device buffers sized up front)
    seed: int = 0  # of the synthetic router

    def check(self, dummy_weights: bool) -> None:
        if self.routing not in ("model", "synthetic") and not self.routing.startswith("replay:"):
            raise ValueError(f"--routing {self.routing!r} is not one of {', '.join(ROUTINGS)}")
        if self.routing == "synthetic" and not dummy_weights:
            raise ValueError("--routing synthetic replaces the router of seeded random weights: "
                             "it needs --dummy-weights")


def make_routing(options: RoutingOptions, cfg: ModelConfig, device: torch.device, dummy_weights: bool) -> Routing:
    options.check(dummy_weights)
    routing: Routing = ModelRouting(cfg.top_k, cfg.renormalize)
    if options.routing == "synthetic":
        routing = SyntheticRouting(SyntheticRouter(cfg.num_layers, cfg.num_experts, cfg.top_k, device, options.seed))
    elif options.routing.startswith("replay:"):
        routing = ReplayRouting(_load(options.routing.removeprefix("replay:"), cfg), routing, device)
    if options.record is None:
        return routing
    return RecordingRouting(routing, cfg.num_layers, cfg.num_experts, cfg.top_k, options.record_tokens, device)


def save_record(recorder: RecordingRouting, path: str) -> None:
    """Write what ``recorder`` holds to ``path`` (reads the device: when a run ends)."""
    trace = recorder.trace()
    trace.save(path)
    log.info("routing record: %d tokens of %d steps written to %s", trace.step.numel(),
             int(trace.step.unique().numel()), path)


def _load(path: str, cfg: ModelConfig) -> RoutingTrace:
    trace = RoutingTrace.load(path)
    got = (trace.num_layers, trace.num_experts, trace.top_k)
    if got != (cfg.num_layers, cfg.num_experts, cfg.top_k):
        raise ValueError(f"routing trace {path} has {got[0]} layers, {got[1]} experts, top {got[2]}; the model has "
                         f"{cfg.num_layers}, {cfg.num_experts}, top {cfg.top_k}")
    return trace
