"""Experts to copy into their cache slots before or while a GEMM reads them (the decode GEMM of
float banks, and one token's over fp8 or 4-bit banks, copies their weights itself; every other
path gathers them first)."""
from __future__ import annotations

from typing import NamedTuple

import torch

from moe_offload.expert_scales import ExpertScales
from moe_offload.kernels.gather_missing import PROGRAMS, gather_missing
from moe_offload.kernels.lookup_admit import CopyPlan

# gather_missing's width for a step's own misses, gathered before its GEMM (0: the wide grid; n: n
# programs). 32: one 9.4 MB miss in 186 us (50.6 GB/s) against the wide grid's 218 (43.3), 2-8
# misses alike (H200, bench_expert_fill.py); scripts/bench_decode.py --gather-programs sets it to compare
MISS_PROGRAMS = PROGRAMS
# gather_missing's width for the misses' scale rows that a fill in the GEMM gathers first (0: the
# wide grid); scripts/bench_decode.py --scale-programs sets it to compare
SCALE_PROGRAMS = 0


class SlotFill(NamedTuple):
    """Experts to copy into their cache slots before or while a GEMM reads them: ``plan``'s rows
    ``i < count`` move ``host_w13[src_id[i]]``, ``host_w2[src_id[i]]`` (and an fp8 bank's scales)
    into slot ``dst_slot[i]``; host banks ``[L*E, ...]`` as ``ExpertCache.fill`` takes them."""

    plan: CopyPlan
    host_w13: torch.Tensor
    host_w2: torch.Tensor
    host_scales: ExpertScales | None = None

    def gather(self, w13: torch.Tensor, w2: torch.Tensor, scales: ExpertScales | None = None,
               backend: str | None = None, programs: int | None = None) -> None:
        """Copy the planned experts into the slot pools ``w13``, ``w2`` (and an fp8 cache's
        ``scales``) now, in stream order: one ``gather_missing`` launch over ``programs`` programs
        (0: its wide grid; None: ``MISS_PROGRAMS``)."""
        programs = MISS_PROGRAMS if programs is None else programs
        if (self.host_scales is None) != (scales is None):
            raise ValueError("quantized slots fill from host scales, float ones from none")
        pools = {} if scales is None else {"host_scales": self.host_scales.tensors(), "slot_scales": scales.tensors()}
        gather_missing(*self.plan, self.host_w13, self.host_w2, w13, w2, backend, **pools, programs=programs)

    def gather_scales(self, slot_scales: tuple[torch.Tensor, ...], backend: str | None = None) -> None:
        """Copy only the planned experts' scale banks into ``slot_scales`` (the slots' banks in
        ``ExpertScales.tensors()`` order), for a GEMM that copies their weights in itself: a few
        hundred kilobytes an expert at most, one ``gather_missing`` launch (``SCALE_PROGRAMS``)."""
        host = self.host_scales.tensors() if self.host_scales is not None else ()
        if len(host) != len(slot_scales) or len(host) < 2:
            raise ValueError(f"the host has {len(host)} scale banks, the slots {len(slot_scales)}")
        gather_missing(*self.plan, host[0], host[1], slot_scales[0], slot_scales[1], backend,
                       host_scales=host[2:], slot_scales=slot_scales[2:], programs=SCALE_PROGRAMS)

    def check_quantized(self, w13: torch.Tensor, w2: torch.Tensor, kind: str) -> None:
        """Before a quantized GEMM fills these slots: the host banks match the pools ``w13``, ``w2``
        row for row (an expert's rows contiguous, same dtype) and carry scales of ``kind`` ("" fp8,
        else 4-bit)."""
        if self.host_scales is None or self.host_scales.kind != kind:
            raise ValueError(f"{kind or 'fp8'} slots fill from the host's {kind or 'fp8'} scales")
        for host, pool in ((self.host_w13, w13), (self.host_w2, w2)):
            if host.shape[1:] != pool.shape[1:] or host.dtype != pool.dtype or not host[0].is_contiguous():
                raise ValueError(f"host bank {tuple(host.shape)} {host.dtype} does not match the slots "
                                 f"{tuple(pool.shape)} {pool.dtype}")
            if host.data_ptr() % 16 or host.stride(0) * host.element_size() % 16:
                # the 4-bit kernels copy mxfp4 rows 16 bytes at a time
                raise ValueError(f"host bank {tuple(host.shape)}: its experts do not start on 16-byte boundaries")
