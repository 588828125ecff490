"""The routing the model runs, built from its ``RoutingOptions``: its own router, the synthetic one
(dummy weights) or a replayed trace, recorded when ``--record-routing`` asks."""
from __future__ import annotations

import logging

import torch

from moe_offload.routing import ModelRouting, Routing, SyntheticRouting
from moe_offload.routing_trace import RecordingRouting, ReplayRouting, RoutingTrace
from moe_offload.synthetic_routing import SyntheticRouter
from worker.config import ModelConfig
from worker.models.linear import linear
from worker.routing_options import RoutingOptions

log = logging.getLogger("sluice.worker")


def make_routing(options: RoutingOptions, cfg: ModelConfig, device: torch.device, dummy_weights: bool) -> Routing:
    options.check(dummy_weights)
    routing: Routing = ModelRouting(cfg.top_k, cfg.renormalize, linear)
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
