"""The names moe_offload's options choose among, in a module without torch: the command lines read
their ``choices`` from here, so ``--help`` answers without importing torch (seconds)."""
from __future__ import annotations

POLICIES = ("lru", "lfru")  # expert cache eviction, see expert_cache.policy_for
EXPERT_DTYPES = ("auto", "bf16", "fp8", "nvfp4", "mxfp4")  # see formats.resolve_expert_format
# "fixed": one fixed-shape invalidate_slots launch per staged layer. "eager": the boolean-mask
# twin (``slot_for_id[held[held >= 0]] = -1``), a hidden device->host sync on the copy stream that
# blocks the host until the previous layer's compute is done; kept to measure what the sync costs.
INVALIDATE_MODES = ("fixed", "eager")
# "kernel": hits device-to-device, misses zero-copy over PCIe (kernels.stage_experts). "memcpy": the
# whole layer from the host by the copy engine, hits included (no PCIe saved, no SMs used).
# "misses": the misses alone by the copy engine, hits read in place from their cache slots; the plan
# stays on the device (a CUDA graph per layer of conditional copies, moe_offload.miss_copies). It
# needs a torch with conditional graph nodes (not the H200 host's 2.11), so it is not measured.
# "mirror": the misses by the copy engine too, hits read in place, planned on the host from a mirror
# of the cache's table that the device copies into pinned memory after every decode step and chunk;
# a gather per layer repairs what the mirror got wrong, so results never depend on it
# (moe_offload.mirrored_misses). "auto": per chunk, "mirror" once the chunk computes enough that the
# SMs the stage kernel holds cost more than the copy engine's calls, else "kernel" (the threshold and the
# H200 chunks behind it: prefill_pipeline.AUTO_COPY_ENGINE_FLOPS_PER_BYTE).
STAGE_MODES = ("kernel", "memcpy", "misses", "mirror", "auto")
# What decode may do with the pipeline's lent slots [0, 2E): "reserve" leaves them to prefill alone
# (2E slots idle between prefills; the invalidation clears nothing); "decode" admits there too, the
# lent slots ranked offloaded.LENT_PENALTY_STEPS steps older than they are as victims, so that they
# hold the coldest entries and a prefill wipes those.
LENT_SLOT_RULES = ("reserve", "decode")
# How decode copies an expert-cache miss into its slot: "gemm": the decode GEMM's gate_up launch
# reads the missed experts from the host banks as it computes and stores them into their slots, so
# the copy overlaps the hits' compute (float banks, decode batches; elsewhere "gather"); "gather":
# a gather launch per bank copies every miss before the GEMM starts.
FILL_MODES = ("gemm", "gather")


def check_choice(what: str, value: str, choices: tuple[str, ...]) -> None:
    """Refuse a ``value`` that is not among ``choices``, naming ``what`` chose it."""
    if value not in choices:
        raise ValueError(f"{what} {value!r} is not one of {choices}")
