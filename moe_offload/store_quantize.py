"""Filling an fp8 expert store from float weights: seeded dummy experts (``--dummy-weights``) and
float checkpoints run with ``--expert-dtype fp8``, quantized block-wise once, while the store is
filled (``moe_offload.fp8``: e4m3, amax per block; ``w13``'s halves keep their own grids).

Both run one expert at a time on a thread pool, so a 58 GB geometry store quantizes in about the
time its bf16 twin takes to fill, and each expert's result depends on nothing but its inputs.
"""
from __future__ import annotations

import functools
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Sequence

import torch

from moe_offload.expert_store import ExpertStore
from moe_offload.experts import ExpertBanks
from moe_offload.fp8 import FP8_MAX, ScaleBlock, quantize
from moe_offload.progress import ProgressBar
from moe_offload.safetensors_file import index_files
from moe_offload.store_fill import CHECKPOINT_STYLES, ExpertNames, detect_names, load_expert_layer

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
    scale.copy_(torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax)))
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
    into the fp8 bank and its scales; returns the fp8 bytes written."""
    dst = getattr(banks, bank)[layer, expert]
    scale = getattr(banks, bank + "_scale")[layer, expert]
    scratch = _float_scratch(dst.shape)
    fill(scratch)
    (quantize_w13_into if bank == "w13" else quantize_into)(scratch, dst, scale, banks.scale_block)
    return dst.nbytes


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


def _copy_from(src: torch.Tensor) -> Callable[[torch.Tensor], object]:
    return lambda t: t.copy_(src)


def fill_dummy_fp8(store: ExpertStore, seed: int, threads: int | None = None) -> None:
    """Seeded ``normal(0, 0.02)`` experts, drawn in float32 with the seeds ``fill_dummy`` gives the
    same matrices, then quantized. Deterministic by ``seed``, whatever the thread count."""
    banks = store.host_banks()
    layers, experts = banks.w13.shape[:2]
    count = layers * experts
    work = [functools.partial(_quantize_matrix, banks, bank, i // experts, i % experts,
                              _draw((seed * 2 * count + b * count + i) % (1 << 63)))
            for b, bank in enumerate(("w13", "w2")) for i in range(count)]
    with ProgressBar(banks.w13.nbytes + banks.w2.nbytes, f"dummy fp8 experts seed={seed}") as bar:
        _run_parallel(work, bar, threads)


def fill_quantized_from_safetensors(store: ExpertStore, files: Sequence[str | Path],
                                    styles: Sequence[ExpertNames] = CHECKPOINT_STYLES,
                                    layers: Sequence[int] | None = None, threads: int | None = None) -> None:
    """Fill an fp8 store from a float checkpoint: each layer is read into a scratch of the
    checkpoint's dtype (exact), then every expert is quantized as ``quantize_w13`` / ``quantize``
    quantize the checkpoint's own tensors."""
    banks = store.host_banks()
    layers = list(range(banks.w13.shape[0])) if layers is None else list(layers)
    if len(layers) != banks.w13.shape[0]:
        raise ValueError(f"{len(layers)} checkpoint layers given for {banks.w13.shape[0]} bank layers")
    index = index_files(list(files))
    names = detect_names(index.keys(), layers[0], styles)
    probe = names.probe.format(layer=layers[0], expert=0)
    dtype = index[probe].tensor(probe).dtype
    src = {"w13": torch.empty(banks.w13.shape[1:], dtype=dtype), "w2": torch.empty(banks.w2.shape[1:], dtype=dtype)}
    with ProgressBar(banks.w13.nbytes + banks.w2.nbytes, f"quantizing experts of {store.identity.label}") as bar:
        for i, layer in enumerate(layers):
            load_expert_layer(index, names, layer, src["w13"], src["w2"])
            work = [functools.partial(_quantize_matrix, banks, bank, i, e, _copy_from(src[bank][e]))
                    for bank in src for e in range(banks.num_experts)]
            _run_parallel(work, bar, threads)
