"""Filling an expert store: from a safetensors checkpoint, or with seeded random weights
(``--dummy-weights``, e.g. the qwen3-30b-geometry benchmark workload, which has no checkpoint)."""
from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple, Sequence

import torch

from moe_offload.expert_store import SHM_DIR, ExpertStore
from moe_offload.expert_names import CHECKPOINT_STYLES, ExpertNames, detect_names
from moe_offload.experts import ExpertBanks
from moe_offload.fp8 import ExpertFormat, w13_scale_shape
from moe_offload.fp8_checkpoint import FP8Scheme, StoredMatrix, read_matrix, to_expert_format
from moe_offload.progress import ProgressBar
from moe_offload.safetensors_file import SafetensorsFile, checkpoint_files, index_files
from moe_offload.store_layout import BankLayout, ExpertGeometry, StoreIdentity, as_format
from moe_offload.store_quantize import fill_dummy_fp8


class ExpertLayer(NamedTuple):
    """One layer's experts in one format: ``w13 [E, 2I, H]``, ``w2 [E, H, I]`` and, for fp8, their
    float32 scale grids ``[E, R, C]`` (``moe_offload.fp8``; ``w13``'s = gate grid on up grid)."""

    w13: torch.Tensor
    w2: torch.Tensor
    w13_scale: torch.Tensor | None = None
    w2_scale: torch.Tensor | None = None


def load_expert_layer(index: dict[str, SafetensorsFile], names: ExpertNames, layer: int, dst: ExpertLayer,
                      target: ExpertFormat, scheme: FP8Scheme | None = None) -> None:
    """Write checkpoint layer ``layer`` into ``dst`` (any device) in ``target``'s format: fp8 experts
    kept (their scales beside them), dequantized for a float target; float experts cast, or
    quantized for an fp8 target. ``scheme`` says how the checkpoint stores fp8 (None: no fp8)."""
    inter, hidden = dst.w2.shape[-1], dst.w2.shape[-2]
    if names.gate_up is not None:
        _load_fused(index, names, layer, dst, target, scheme)
        return
    for e in range(dst.w13.shape[0]):
        for half, template, shape in ((0, names.gate, (inter, hidden)), (1, names.up, (inter, hidden)),
                                      (None, names.down, (hidden, inter))):
            matrix = read_matrix(index, template.format(layer=layer, expert=e), shape, scheme)
            _put(dst, e, half, to_expert_format(matrix, scheme, target))


def read_expert_layer(index: dict[str, SafetensorsFile], names: ExpertNames, layer: int, geometry: ExpertGeometry,
                      target: ExpertFormat, scheme: FP8Scheme | None = None) -> ExpertLayer:
    """Checkpoint layer ``layer`` in ``target``'s format, in new CPU tensors."""
    dst = empty_expert_layer(geometry, target, torch.device("cpu"))
    load_expert_layer(index, names, layer, dst, target, scheme)
    return dst


def empty_expert_layer(geometry: ExpertGeometry, target: ExpertFormat, device: torch.device,
                       num_layers: tuple[int, ...] = ()) -> ExpertLayer:
    """Uninitialised banks of ``target``'s format, ``[*num_layers, E, ...]``."""
    lead = (*num_layers, geometry.num_experts)
    two_i, hidden, inter = 2 * geometry.intermediate, geometry.hidden, geometry.intermediate
    w13 = torch.empty(*lead, two_i, hidden, dtype=target.dtype, device=device)
    w2 = torch.empty(*lead, hidden, inter, dtype=target.dtype, device=device)
    if not target.quantized:
        return ExpertLayer(w13, w2)
    block = target.scale_block
    return ExpertLayer(w13, w2, torch.empty(*lead, *w13_scale_shape(block, inter, hidden), device=device),
                       torch.empty(*lead, *block.scale_shape(hidden, inter), device=device))


def _put(dst: ExpertLayer, e: int | slice, half: int | None, matrix: StoredMatrix) -> None:
    """``matrix`` into expert ``e``'s ``w2`` (``half`` None) or its gate (0) or up (1) rows of ``w13``;
    each half of ``w13``'s scale grid is that half's own grid."""
    if half is None:
        weight, scale = dst.w2[e], None if dst.w2_scale is None else dst.w2_scale[e]
    else:
        weight = _half_rows(dst.w13[e], half)
        scale = None if dst.w13_scale is None else _half_rows(dst.w13_scale[e], half)
    weight.copy_(matrix.weight)
    if scale is not None:
        scale.copy_(matrix.scale)


def _half_rows(t: torch.Tensor, half: int) -> torch.Tensor:
    rows = t.shape[-2] // 2
    return t[..., half * rows:(half + 1) * rows, :]


def _load_fused(index: dict[str, SafetensorsFile], names: ExpertNames, layer: int, dst: ExpertLayer,
                target: ExpertFormat, scheme: FP8Scheme | None) -> None:
    """The transformers-5 layout, float only: a fused fp8 ``gate_up`` carries one scale grid over
    ``[2I, H]``, not the two halves' grids that Sluice's fp8 experts use."""
    w13, w2 = _read_fused(index, names, layer, dst, scheme)
    if w13.scale is not None or w2.scale is not None:
        raise ValueError(f"fused fp8 experts ({names.gate_up.format(layer=layer)}) are not supported; "
                         "Sluice reads fp8 experts stored one expert per tensor")
    for half in (0, 1):
        _put(dst, slice(None), half, to_expert_format(StoredMatrix(_half_rows(w13.weight, half)), None, target))
    _put(dst, slice(None), None, to_expert_format(w2, None, target))


def _read_fused(index: dict[str, SafetensorsFile], names: ExpertNames, layer: int, dst: ExpertLayer,
                scheme: FP8Scheme | None) -> tuple[StoredMatrix, StoredMatrix]:
    """A fused layer as ``w13 [E, 2I, H]`` (gate rows, then up rows) and ``w2 [E, H, I]``;
    gpt-oss's transposed, interleaved layout (``ExpertNames``) is turned so here."""
    if names.gate_up_bias is None:
        return (read_matrix(index, names.gate_up.format(layer=layer), dst.w13.shape, scheme),
                read_matrix(index, names.down.format(layer=layer), dst.w2.shape, scheme))
    E, two_i, hidden = dst.w13.shape
    m13 = read_matrix(index, names.gate_up.format(layer=layer), (E, hidden, two_i), scheme)
    m2 = read_matrix(index, names.down.format(layer=layer), (E, two_i // 2, hidden), scheme)
    if m13.scale is not None or m2.scale is not None:
        raise ValueError(f"fp8 experts in gpt-oss's layout ({names.gate_up.format(layer=layer)}) are not supported")
    w13, w2 = m13.weight, m2.weight
    gate_up = w13.transpose(1, 2).unflatten(1, (-1, 2)).transpose(1, 2).flatten(1, 2)  # rows g0 u0 g1 u1 ..
    return StoredMatrix(gate_up), StoredMatrix(w2.transpose(1, 2))


def fill_from_safetensors(
    store: ExpertStore,
    files: Sequence[str | Path],
    styles: Sequence[ExpertNames] = CHECKPOINT_STYLES,
    layers: Sequence[int] | None = None,
    scheme: FP8Scheme | None = None,
) -> None:
    """Fill the store's banks from a (sharded) checkpoint, in the banks' format (their dtype, and
    their scales' block for fp8). ``layers[i]`` is the checkpoint layer of bank layer ``i``
    (default: the same index), for models whose first layers are dense; ``scheme`` says how the
    checkpoint stores fp8 weights (None: it has none)."""
    banks = store.host_banks()
    target = ExpertFormat(banks.w13.dtype, banks.scale_block)
    layers = list(range(banks.w13.shape[0])) if layers is None else list(layers)
    if len(layers) != banks.w13.shape[0]:
        raise ValueError(f"{len(layers)} checkpoint layers given for {banks.w13.shape[0]} bank layers")
    index = index_files(list(files))
    names = detect_names(index.keys(), layers[0], styles)
    with ProgressBar(_nbytes(banks), f"loading experts of {store.identity.label}") as bar:
        for i, layer in enumerate(layers):
            dst = _bank_layer(banks, i)
            load_expert_layer(index, names, layer, dst, target, scheme)
            bar.advance(_nbytes(dst))


def _bank_layer(banks: ExpertBanks, i: int) -> ExpertLayer:
    scales = (banks.w13_scale[i], banks.w2_scale[i]) if banks.quantized else (None, None)
    return ExpertLayer(banks.w13[i], banks.w2[i], *scales)


def _nbytes(tensors: ExpertBanks | ExpertLayer) -> int:
    return sum(t.nbytes for t in tensors[:4] if t is not None)


_scratch = threading.local()


def _fill_random(chunk: torch.Tensor, seed: int) -> int:
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.numel() < chunk.numel():
        buf = _scratch.buf = torch.empty(chunk.numel(), dtype=torch.float32)
    # float32 normal_ has a vectorised path and is about twice as fast as normal_ in bf16
    src = buf[: chunk.numel()].normal_(0.0, 0.02, generator=torch.Generator().manual_seed(seed))
    chunk.copy_(src.view(chunk.shape))
    return chunk.nbytes


def fill_dummy(store: ExpertStore, seed: int, threads: int | None = None) -> None:
    """Seeded ``normal(0, 0.02)`` values in every bank, one chunk per expert matrix. Each chunk has its
    own generator, so the values depend on ``seed`` only, not on the thread count or order."""
    chunks = []
    for spec in store.layout.banks:
        if not spec.dtype.is_floating_point or spec.dtype.itemsize < 2:
            raise ValueError(f"bank {spec.name} is {spec.dtype}; dummy weights need a float dtype "
                             f"(fp8 stores are filled by store_quantize.fill_dummy_fp8)")
        bank = store.bank(spec.name)
        chunks.extend(bank.reshape(-1, *bank.shape[-2:]).unbind(0) if bank.dim() > 2 else [bank])
    seeds = [(seed * len(chunks) + i) % (1 << 63) for i in range(len(chunks))]
    threads = threads or len(os.sched_getaffinity(0))
    intra_op = torch.get_num_threads()
    torch.set_num_threads(1)  # the parallelism is across chunks; nested intra-op pools would oversubscribe
    try:
        with ProgressBar(sum(c.nbytes for c in chunks), f"dummy experts seed={seed}") as bar:
            with ThreadPoolExecutor(threads) as pool:
                for nbytes in pool.map(_fill_random, chunks, seeds):
                    bar.advance(nbytes)
    finally:
        torch.set_num_threads(intra_op)


def open_checkpoint_experts(
    path: str | Path,
    geometry: ExpertGeometry,
    fmt: ExpertFormat | torch.dtype,
    styles: Sequence[ExpertNames] = CHECKPOINT_STYLES,
    layers: Sequence[int] | None = None,
    shm_dir: str | Path = SHM_DIR,
    scheme: FP8Scheme | None = None,
) -> ExpertStore:
    """The store of a checkpoint directory (or file) with its experts in ``fmt``: reused if it
    exists, else read once (``scheme``: how the checkpoint stores fp8 weights, see
    ``fill_from_safetensors``; float experts stored as fp8 are quantized while the store fills)."""
    files, fmt = checkpoint_files(path), as_format(fmt)
    return ExpertStore.open_or_create(
        StoreIdentity.checkpoint(path, fmt),
        BankLayout.experts(geometry, fmt),
        lambda store: fill_from_safetensors(store, files, styles, layers, scheme),
        shm_dir,
    )


def open_dummy_experts(geometry: ExpertGeometry, seed: int, fmt: ExpertFormat | torch.dtype,
                       shm_dir: str | Path = SHM_DIR) -> ExpertStore:
    """Seeded random experts in format ``fmt`` (fp8: drawn in float32 and quantized)."""
    fmt = as_format(fmt)
    fill = fill_dummy_fp8 if fmt.quantized else fill_dummy
    return ExpertStore.open_or_create(
        StoreIdentity.dummy(geometry, seed, fmt), BankLayout.experts(geometry, fmt), lambda s: fill(s, seed), shm_dir
    )
