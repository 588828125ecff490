"""Seeded dummy experts in a quantized format (``--dummy-weights --expert-dtype fp8|nvfp4|mxfp4``):
drawn in float32 as the bf16 ones are and quantized while the store is filled (fp8 block-wise in
place, ``moe_offload.fp8``; 4-bit through its room, ``moe_offload.formats``; ``w13``'s halves keep
their own scales).

One matrix at a time on a thread pool, quantized in place in its float32 scratch, so the 58 GB
geometry store fills in fp8 about as fast as in bf16; each matrix depends on its seed only.
(A float checkpoint run in fp8 is quantized by ``store_fill.fill_from_safetensors``.)
"""
from __future__ import annotations

import functools
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import torch

from moe_offload.expert_store import ExpertStore
from moe_offload.experts import ExpertBanks
from moe_offload.formats import quantize_w13, room_of
from moe_offload.fp8 import FP8_MAX, ScaleBlock, amax_scale, quantize
from moe_offload.progress import ProgressBar

DUMMY_STD = 0.02  # as fill_dummy's bf16 experts

_scratch = threading.local()


def quantize_into(w: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, block: ScaleBlock) -> None:
    """``q, scale = fp8.quantize(w, block)``, bit for bit, written into ``q [N, K]`` and
    ``scale [R, C]``. A float32 ``w`` whose shape is a multiple of the block is used as scratch
    (divided in place: no full-size temporaries); any other goes through ``fp8.quantize``."""
    rows, cols = w.shape
    col_block = block.col_block(cols)
    if w.dtype != torch.float32 or not w.is_contiguous() or rows % block.rows or cols % col_block:
        q_new, scale_new = quantize(w, block)
        q.copy_(q_new)
        scale.copy_(scale_new)
        return
    tiles = w.view(rows // block.rows, block.rows, cols // col_block, col_block)
    amax = torch.maximum(tiles.amax(dim=(1, 3)), tiles.amin(dim=(1, 3)).neg_())
    scale.copy_(amax_scale(amax))
    tiles.div_(scale[:, None, :, None]).clamp_(-FP8_MAX, FP8_MAX)
    q.copy_(w)


def quantize_w13_into(w13: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, block: ScaleBlock) -> None:
    """``fp8.quantize_w13`` into ``q [2I, H]``, ``scale [2R, C]``: each half on its own grid."""
    inter, grid = w13.shape[0] // 2, scale.shape[0] // 2
    quantize_into(w13[:inter], q[:inter], scale[:grid], block)
    quantize_into(w13[inter:], q[inter:], scale[grid:], block)


def _float_scratch(shape: torch.Size) -> torch.Tensor:
    numel = shape.numel()
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.numel() < numel:
        buf = _scratch.buf = torch.empty(numel, dtype=torch.float32)
    return buf[:numel].view(shape)


def _quantize_matrix(banks: ExpertBanks, bank: str, layer: int, expert: int,
                     fill: Callable[[torch.Tensor], object]) -> int:
    """``fill`` a float32 scratch with one expert's ``w13 [2I, H]`` or ``w2 [H, I]``, quantize it
    into the fp8 bank and its scales; returns the bytes written."""
    dst = getattr(banks, bank)[layer, expert]
    scale = getattr(banks, bank + "_scale")[layer, expert]
    scratch = _float_scratch(dst.shape)
    fill(scratch)
    (quantize_w13_into if bank == "w13" else quantize_into)(scratch, dst, scale, banks.scale_block)
    return dst.nbytes + scale.nbytes


def _run_parallel(work: list[Callable[[], int]], bar: ProgressBar, threads: int | None) -> None:
    """Run ``work`` (each returns the bytes it wrote) on a thread pool of single-threaded torch."""
    threads = threads or len(os.sched_getaffinity(0))
    intra_op = torch.get_num_threads()
    torch.set_num_threads(1)  # the parallelism is across matrices; nested intra-op pools would oversubscribe
    try:
        with ThreadPoolExecutor(threads) as pool:
            for done in pool.map(lambda fn: fn(), work):
                bar.advance(done)
    finally:
        torch.set_num_threads(intra_op)


def _draw(seed: int) -> Callable[[torch.Tensor], object]:
    return lambda t: t.normal_(0.0, DUMMY_STD, generator=torch.Generator().manual_seed(seed))


def fill_dummy_fp8(store: ExpertStore, seed: int, threads: int | None = None) -> None:
    """Seeded ``normal(0, 0.02)`` experts, drawn in float32 with the seeds ``fill_dummy`` gives the
    same matrices, then quantized. Deterministic by ``seed``, whatever the thread count."""
    _fill_dummy(store, seed, threads, _quantize_matrix)


def _quantize_parts(banks: ExpertBanks, bank: str, layer: int, expert: int,
                    fill: Callable[[torch.Tensor], object]) -> int:
    """``fill`` a float32 scratch with one expert's logical ``w13 [2I, H]`` or ``w2 [H, I]`` and
    write its parts in the banks' format (any room); returns the bytes written."""
    fmt, inter, hidden = banks.format, banks.w13.shape[-2] // 2, banks.w2.shape[-2]
    scratch = _float_scratch(torch.Size((2 * inter, hidden) if bank == "w13" else (hidden, inter)))
    fill(scratch)
    parts = quantize_w13(fmt, scratch) if bank == "w13" else room_of(fmt).quantize(fmt, scratch)
    dsts = [t[layer, expert] for t in (getattr(banks, bank + s) for s in ("", "_scale", "_channel_scale"))
            if t is not None]
    for dst, part in zip(dsts, parts):
        dst.copy_(part)
    return sum(d.nbytes for d in dsts)


def fill_dummy_fp4(store: ExpertStore, seed: int, threads: int | None = None) -> None:
    """4-bit dummy experts at the speed of the random generator rather than the quantizer's (which
    writes about 0.25 GB/s on 16 cores: four minutes for gpt-oss-120b's 61 GB): expert 0 of layer 0
    of each bank is a ``normal(0, 0.02)`` draw quantized by the format's room, and every other
    matrix takes its scale parts and seeded random e2m1 codes (uniform over the 16, so the values
    keep about the draw's spread, std ≈ 0.02). Not the quantized float draws that fp8 fills: a
    4-bit dummy store's values relate to no bf16 one, only its bytes and shapes do."""
    banks = store.host_banks()
    layers, experts = banks.w13.shape[:2]
    count = layers * experts
    work = []
    for b, bank in enumerate(("w13", "w2")):
        _quantize_parts(banks, bank, 0, 0, _draw((seed * 2 * count + b * count) % (1 << 63)))
        work += [functools.partial(_random_codes, banks, bank, i // experts, i % experts,
                                   (seed * 2 * count + b * count + i) % (1 << 63)) for i in range(1, count)]
    total = sum(t.nbytes for t in banks.tensors())
    with ProgressBar(total, f"dummy {banks.format.name} experts seed={seed} (random codes)") as bar:
        bar.advance(total - sum(_matrix_bytes(banks, bank) for bank in ("w13", "w2")) * (count - 1))
        _run_parallel(work, bar, threads)


def _parts_of(banks: ExpertBanks, bank: str) -> list[torch.Tensor]:
    return [t for t in (getattr(banks, bank + s) for s in ("", "_scale", "_channel_scale")) if t is not None]


def _matrix_bytes(banks: ExpertBanks, bank: str) -> int:
    return sum(t[0, 0].nbytes for t in _parts_of(banks, bank))


def _random_codes(banks: ExpertBanks, bank: str, layer: int, expert: int, seed: int) -> int:
    """One matrix of ``fill_dummy_fp4``: random packed codes, expert (0, 0)'s scale parts."""
    packed, *scales = _parts_of(banks, bank)
    dst = packed[layer, expert]
    words = dst.view(-1).view(torch.int64) if dst.numel() % 8 == 0 else dst.view(-1)
    words.random_(generator=torch.Generator().manual_seed(seed))  # int64: 63 random bits of 64; uint8: all 8
    for part in scales:
        part[layer, expert].copy_(part[0, 0])
    return dst.nbytes + sum(part[0, 0].nbytes for part in scales)


def _fill_dummy(store: ExpertStore, seed: int, threads: int | None,
                quantize_one: Callable[[ExpertBanks, str, int, int, Callable], int]) -> None:
    """Each matrix of both banks drawn from its own seed and written by ``quantize_one``, on the pool."""
    banks = store.host_banks()
    layers, experts = banks.w13.shape[:2]
    count = layers * experts
    work = [functools.partial(quantize_one, banks, bank, i // experts, i % experts,
                              _draw((seed * 2 * count + b * count + i) % (1 << 63)))
            for b, bank in enumerate(("w13", "w2")) for i in range(count)]
    total = sum(t.nbytes for t in banks.tensors())
    with ProgressBar(total, f"dummy {banks.format.name} experts seed={seed}") as bar:
        _run_parallel(work, bar, threads)
