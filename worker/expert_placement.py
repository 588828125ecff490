"""Where the experts run from: all resident on the device, or in the shared-memory expert store
behind a GPU expert cache of as many slots as the memory plan gives (``--moe-cache-size`` /
``--moe-cache-fraction`` / ``--moe-cache-auto``); and in which format (``--expert-dtype``: bf16, or
fp8 with block scales, nvfp4, mxfp4: ``moe_offload.formats``)."""
from __future__ import annotations

import logging

import torch

from moe_offload.expert_cache import slot_bytes
from moe_offload.expert_store import ExpertStore
from moe_offload.experts import ExpertBanks, Experts, ResidentExperts
from moe_offload.formats import ExpertFormat
from moe_offload.offloaded import OffloadedExperts
from moe_offload.store_fill import open_checkpoint_experts, open_dummy_experts
from moe_offload.store_layout import ExpertGeometry
from worker.config import ModelConfig
from worker.loader import checkpoint_errors
from worker.runner_config import ExpertOptions

log = logging.getLogger("sluice.worker")

__all__ = ["ExpertOptions", "expert_slot_bytes", "open_store", "place_experts"]


def expert_geometry(cfg: ModelConfig) -> ExpertGeometry:
    """The shape of ``cfg``'s routed experts, as the expert store lays them out."""
    return ExpertGeometry(cfg.num_layers, cfg.num_experts, cfg.hidden_size, cfg.expert_intermediate_size)


def expert_slot_bytes(cfg: ModelConfig, fmt: ExpertFormat) -> int:
    """Bytes of one expert in ``fmt``: what a cache slot holds (the memory plan's unit)."""
    hidden, inter = cfg.hidden_size, cfg.expert_intermediate_size
    return slot_bytes((2 * inter, hidden), (hidden, inter), fmt.dtype, fmt.scale_block, fmt.kind)


def open_store(cfg: ModelConfig, model_dir: str, options: ExpertOptions, fmt: ExpertFormat,
               device: torch.device) -> ExpertStore | None:
    """The expert store, filled in ``fmt`` (a checkpoint run in another format is converted once, at
    fill) and registered with CUDA; None when the experts are loaded with the weights."""
    if not options.uses_store:
        return None
    geometry = expert_geometry(cfg)
    if options.dummy_weights:
        store = open_dummy_experts(geometry, options.seed, fmt)
    else:
        with checkpoint_errors():
            store = open_checkpoint_experts(model_dir, geometry, fmt, scheme=cfg.quantization)
    if device.type == "cuda":
        store.register_cuda(device)
    return store


def place_experts(cfg: ModelConfig, options: ExpertOptions, resident: ExpertBanks, store: ExpertStore | None,
                  slots: int, device: torch.device) -> Experts:
    """The ``Experts`` backend: ``resident`` (the banks the checkpoint loader filled) without a
    store; else a cache of ``slots`` (the memory plan's) in front of the store, or every expert
    copied to the device when ``slots`` holds them all."""
    if store is None:
        return ResidentExperts(resident)
    host = store.host_banks()
    total = cfg.num_layers * cfg.num_experts
    if slots >= total:
        log.info("expert cache holds all %d experts: running fully resident", total)
        return ResidentExperts(host.to(device))
    pipeline = options.prefill_pipeline and slots >= 3 * cfg.num_experts
    if options.prefill_pipeline and not pipeline:
        log.warning("expert cache of %d slots is below the %d the prefill pipeline needs (2x%d lent, %d for decode): "
                    "prefill runs through the cache", slots, 3 * cfg.num_experts, cfg.num_experts, cfg.num_experts)
    banks = store.device_banks() if device.type == "cuda" else host
    experts = OffloadedExperts.create(banks, slots, device, options.policy, pipeline=pipeline,
                                      invalidate=options.prefill_invalidate, stage=options.prefill_stage,
                                      lent_slots=options.lent_slots, prefetch=options.prefetch,
                                      fill=options.fill, prefetch_cap=options.prefetch_cap)
    experts.store = store  # keep the mapping alive as long as the experts
    return experts
