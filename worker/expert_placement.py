"""Where the experts run from: all resident on the device, or in the shared-memory expert store
behind a GPU expert cache of ``--moe-cache-size`` / ``--moe-cache-fraction`` / ``--moe-cache-auto``;
and in which format (``--expert-dtype``: bf16, or fp8 with block scales, see ``moe_offload.fp8``)."""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from moe_offload.expert_cache import resolve_cache_slots, slot_bytes
from moe_offload.experts import ExpertBanks, Experts, ResidentExperts
from moe_offload.fp8 import ExpertFormat
from moe_offload.offloaded import OffloadedExperts
from moe_offload.store_fill import open_checkpoint_experts, open_dummy_experts
from moe_offload.store_layout import ExpertGeometry
from worker.config import ModelConfig
from worker.device_memory import DeviceMemory
from worker.loader import checkpoint_errors

log = logging.getLogger("sluice.worker")


@dataclass(frozen=True)
class ExpertOptions:
    cache_size: int | None = None  # slots
    cache_fraction: float | None = None  # of all experts
    cache_auto: bool = False  # fill the GPU memory left after weights, activations and a KV floor
    policy: str = "lfru"
    kv_reserve_tokens: int = 32768  # the KV floor --moe-cache-auto leaves
    dummy_weights: bool = False
    seed: int = 0
    prefill_pipeline: bool = True  # stream prefill chunks' experts through a double buffer (needs 3E slots)
    prefill_invalidate: str = "fixed"  # "eager": the boolean-mask invalidation, a hidden sync (A/B only)
    prefill_stage: str = "auto"  # "kernel" | "memcpy" | "auto" (per chunk), see prefill_pipeline.STAGE_MODES
    expert_dtype: str = "auto"  # "auto" | "bf16" | "fp8", see fp8.resolve_expert_format
    lent_slots: str = "reserve"  # decode and the pipeline's lent slots: offloaded.LENT_SLOT_RULES
    # cross-layer prefetch at decode (moe_offload.expert_prefetch); off until measured on the H200
    prefetch: bool = False

    @property
    def uses_store(self) -> bool:
        given = [n for n, v in (("--moe-cache-size", self.cache_size), ("--moe-cache-fraction", self.cache_fraction),
                                ("--moe-cache-auto", self.cache_auto or None)) if v is not None]
        if len(given) > 1:
            raise ValueError(f"{' and '.join(given)} are mutually exclusive")
        return bool(given) or self.dummy_weights


def place_experts(cfg: ModelConfig, model_dir: str, options: ExpertOptions, resident: ExpertBanks,
                  dtype: torch.dtype, device: torch.device, activation_bytes: int, memory: DeviceMemory,
                  fmt: ExpertFormat | None = None) -> Experts:
    """The ``Experts`` backend, its experts in ``fmt`` (default: float in ``dtype``). ``resident``
    holds the banks when the checkpoint loader filled them in ``fmt`` (no store); otherwise the
    experts come from the store, filled in ``fmt`` (a float checkpoint run in fp8 is quantized
    once, at fill)."""
    fmt = fmt or ExpertFormat(dtype)
    if not options.uses_store:
        return ResidentExperts(resident)
    geometry = ExpertGeometry(cfg.num_layers, cfg.num_experts, cfg.hidden_size, cfg.expert_intermediate_size)
    if options.dummy_weights:
        store = open_dummy_experts(geometry, options.seed, fmt)
    else:
        with checkpoint_errors():
            store = open_checkpoint_experts(model_dir, geometry, fmt, scheme=cfg.quantization)
    if device.type == "cuda":
        store.register_cuda(device)
    host = store.host_banks()
    total = cfg.num_layers * cfg.num_experts
    one_slot = slot_bytes(tuple(host.w13.shape[2:]), tuple(host.w2.shape[2:]), host.w13.dtype, host.scale_block)
    slots = resolve_cache_slots(total, one_slot, **_sizing(options, cfg, dtype, memory, activation_bytes))
    if slots < cfg.num_experts:
        raise ValueError(f"the expert cache would hold {slots} experts; it needs at least one layer's "
                         f"{cfg.num_experts} (a prefill chunk can route to all of them)")
    if slots >= total:
        log.info("expert cache holds all %d experts: running fully resident", total)
        return ResidentExperts(host.to(device))
    log.info("expert cache: %d of %d %s experts (%.1f%%, %.2f GB), policy %s", slots, total, fmt.name,
             100 * slots / total, slots * one_slot / 1e9, options.policy)
    pipeline = options.prefill_pipeline and slots >= 3 * cfg.num_experts
    if options.prefill_pipeline and not pipeline:
        log.warning("expert cache of %d slots is below the %d the prefill pipeline needs (2x%d lent, %d for decode): "
                    "prefill runs through the cache", slots, 3 * cfg.num_experts, cfg.num_experts, cfg.num_experts)
    banks = store.device_banks() if device.type == "cuda" else host
    experts = OffloadedExperts.create(banks, slots, device, options.policy, pipeline=pipeline,
                                      invalidate=options.prefill_invalidate, stage=options.prefill_stage,
                                      lent_slots=options.lent_slots, prefetch=options.prefetch)
    experts.store = store  # keep the mapping alive as long as the experts
    return experts


def _sizing(options: ExpertOptions, cfg: ModelConfig, dtype: torch.dtype, memory: DeviceMemory,
            activation_bytes: int) -> dict:
    if options.cache_size is not None:
        return {"size": options.cache_size}
    if options.cache_fraction is not None:
        return {"fraction": options.cache_fraction}
    if not options.cache_auto:  # --dummy-weights alone: everything resident
        return {"fraction": 1.0}
    if memory.device.type != "cuda":
        raise ValueError("--moe-cache-auto sizes the cache from free GPU memory; give --moe-cache-size on CPU")
    free = memory.free()
    kv_floor = options.kv_reserve_tokens * 2 * cfg.num_layers * cfg.kv_size * torch.empty((), dtype=dtype).element_size()
    return {"auto_free_bytes": max(free - activation_bytes - kv_floor, 0)}
