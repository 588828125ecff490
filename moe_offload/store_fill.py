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
from moe_offload.formats import ExpertFormat, bank_specs
from moe_offload.checkpoint_matrix import StoredMatrix
from moe_offload.fp8_checkpoint import Scheme, read_matrix, to_expert_format
from moe_offload.progress import ProgressBar
from moe_offload.safetensors_file import SafetensorsFile, checkpoint_files, index_files
from moe_offload.store_layout import BankLayout, ExpertGeometry, StoreIdentity, as_format
from moe_offload.store_quantize import fill_dummy_fp4, fill_dummy_fp8


class ExpertLayer(NamedTuple):
    """One layer's experts in one format: ``w13``, ``w2`` and their scale banks, named and shaped
    as ``formats.bank_specs`` says (``[E, ...]``; ``w13``'s scales = the gate's on the up's)."""

    w13: torch.Tensor
    w2: torch.Tensor
    w13_scale: torch.Tensor | None = None
    w2_scale: torch.Tensor | None = None
    w13_channel_scale: torch.Tensor | None = None
    w2_channel_scale: torch.Tensor | None = None

    @property
    def logical(self) -> tuple[int, int, int]:
        """``(E, I, H)``: packed 4-bit banks are half as wide as the matrices they hold."""
        return self.w13.shape[-3], self.w13.shape[-2] // 2, self.w2.shape[-2]


def load_expert_layer(index: dict[str, SafetensorsFile], names: ExpertNames, layer: int, dst: ExpertLayer,
                      target: ExpertFormat, scheme: Scheme | None = None) -> None:
    """Write checkpoint layer ``layer`` into ``dst`` (any device) in ``target``'s format: quantized
    experts kept (their scales beside them) or dequantized for a float target; float experts cast,
    or quantized (``fp8_checkpoint.to_expert_format``). ``scheme`` says how the checkpoint stores
    quantized weights (None: it has none)."""
    _, inter, hidden = dst.logical
    if names.gate_up is not None:
        _load_fused(index, names, layer, dst, target, scheme)
        return
    for e in range(dst.w13.shape[0]):
        for half, template, shape in ((0, names.gate, (inter, hidden)), (1, names.up, (inter, hidden)),
                                      (None, names.down, (hidden, inter))):
            matrix = read_matrix(index, template.format(layer=layer, expert=e), shape, scheme)
            _put(dst, e, half, to_expert_format(matrix, scheme, target))


def read_expert_layer(index: dict[str, SafetensorsFile], names: ExpertNames, layer: int, geometry: ExpertGeometry,
                      target: ExpertFormat, scheme: Scheme | None = None) -> ExpertLayer:
    """Checkpoint layer ``layer`` in ``target``'s format, in new CPU tensors."""
    dst = empty_expert_layer(geometry, target, torch.device("cpu"))
    load_expert_layer(index, names, layer, dst, target, scheme)
    return dst


def empty_expert_layer(geometry: ExpertGeometry, target: ExpertFormat, device: torch.device,
                       num_layers: tuple[int, ...] = ()) -> ExpertLayer:
    """Uninitialised banks of ``target``'s format, ``[*num_layers, E, ...]``."""
    lead = (*num_layers, geometry.num_experts)
    specs = bank_specs(target, geometry.intermediate, geometry.hidden)
    return ExpertLayer(**{name: torch.empty(*lead, *shape, dtype=dtype, device=device)
                          for name, (shape, dtype) in specs.items()})


def bank_layer(banks: ExpertBanks, i: int) -> ExpertLayer:
    """Layer ``i`` of stacked banks, as views."""
    return ExpertLayer(*(None if t is None else t[i] for t in (getattr(banks, n) for n in ExpertLayer._fields)))


def _put(dst: ExpertLayer, e: int | slice, half: int | None, matrix: StoredMatrix) -> None:
    """``matrix``'s parts into expert ``e``'s ``w2`` banks (``half`` None) or the gate (0) or up (1)
    rows of its ``w13`` banks: each half of ``w13`` keeps its own scales."""
    prefix = "w2" if half is None else "w13"
    for suffix, part in zip(("", "_scale", "_channel_scale"), matrix[:3]):
        bank = getattr(dst, prefix + suffix)
        if (bank is None) != (part is None):
            raise ValueError(f"a {matrix.fmt.name if matrix.fmt else 'float'} matrix does not fit the banks {prefix}")
        if bank is not None:
            (bank[e] if half is None else _half_rows(bank[e], half)).copy_(part)


def _half_rows(t: torch.Tensor, half: int) -> torch.Tensor:
    rows = t.shape[-2] // 2
    return t[..., half * rows:(half + 1) * rows, :]


def _load_fused(index: dict[str, SafetensorsFile], names: ExpertNames, layer: int, dst: ExpertLayer,
                target: ExpertFormat, scheme: Scheme | None) -> None:
    """The transformers-5 layout, float or 4-bit (whose scales are per row, so the halves split
    exactly): a fused fp8 ``gate_up`` carries one scale grid over ``[2I, H]``, not the two halves'
    grids that Sluice's fp8 experts use."""
    w13, w2 = _read_fused(index, names, layer, dst, scheme)
    if any(m.fmt is not None and m.fmt.family == "fp8" for m in (w13, w2)):
        raise ValueError(f"fused fp8 experts ({names.gate_up.format(layer=layer)}) are not supported; "
                         "Sluice reads fp8 experts stored one expert per tensor")
    for half in (0, 1):
        _put(dst, slice(None), half, to_expert_format(w13.map(lambda t: _half_rows(t, half)), scheme, target))
    _put(dst, slice(None), None, to_expert_format(w2, scheme, target))


def _read_fused(index: dict[str, SafetensorsFile], names: ExpertNames, layer: int, dst: ExpertLayer,
                scheme: Scheme | None) -> tuple[StoredMatrix, StoredMatrix]:
    """A fused layer as ``w13 [E, 2I, H]`` (gate rows, then up rows) and ``w2 [E, H, I]``;
    gpt-oss's layouts (``ExpertNames``: float transposed, gate and up alternating; MXFP4 blocks by
    rows, alternating) are turned so here."""
    E, inter, hidden = dst.logical
    gate_up = names.gate_up.format(layer=layer)
    if names.gate_up_bias is None or gate_up + "_blocks" in index:  # gpt-oss's MXFP4 is [E, 2I, H] already,
        m13 = read_matrix(index, gate_up, (E, 2 * inter, hidden), scheme)  # its rows gate and up alternating
        m2 = read_matrix(index, names.down.format(layer=layer), (E, hidden, inter), scheme)
        return (m13 if names.gate_up_bias is None else m13.map(_deinterleave_rows)), m2
    m13 = read_matrix(index, gate_up, (E, hidden, 2 * inter), scheme)  # float: transposed
    m2 = read_matrix(index, names.down.format(layer=layer), (E, inter, hidden), scheme)
    if m13.scale is not None or m2.scale is not None:
        raise ValueError(f"fp8 experts in gpt-oss's layout ({gate_up}) are not supported")
    return StoredMatrix(_deinterleave_rows(m13.weight.transpose(1, 2))), StoredMatrix(m2.weight.transpose(1, 2))


def _deinterleave_rows(t: torch.Tensor) -> torch.Tensor:
    """``[E, 2I, ...]`` rows g0 u0 g1 u1 ... -> gate rows, then up rows."""
    return t.unflatten(1, (-1, 2)).transpose(1, 2).flatten(1, 2)


def fill_from_safetensors(
    store: ExpertStore,
    files: Sequence[str | Path],
    styles: Sequence[ExpertNames] = CHECKPOINT_STYLES,
    layers: Sequence[int] | None = None,
    scheme: Scheme | None = None,
) -> None:
    """Fill the store's banks from a (sharded) checkpoint, in the banks' format (their dtype, and
    their scale banks). ``layers[i]`` is the checkpoint layer of bank layer ``i``
    (default: the same index), for models whose first layers are dense; ``scheme`` says how the
    checkpoint stores quantized weights (None: it has none)."""
    banks = store.host_banks()
    target = banks.format
    layers = list(range(banks.w13.shape[0])) if layers is None else list(layers)
    if len(layers) != banks.w13.shape[0]:
        raise ValueError(f"{len(layers)} checkpoint layers given for {banks.w13.shape[0]} bank layers")
    index = index_files(list(files))
    names = detect_names(index.keys(), layers[0], styles)
    with ProgressBar(_nbytes(banks), f"loading experts of {store.identity.label}") as bar:
        for i, layer in enumerate(layers):
            dst = bank_layer(banks, i)
            load_expert_layer(index, names, layer, dst, target, scheme)
            bar.advance(_nbytes(dst))


def _nbytes(tensors: ExpertBanks | ExpertLayer) -> int:
    return sum(t.nbytes for t in tensors if isinstance(t, torch.Tensor))


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
                             f"(quantized stores are filled by store_quantize)")
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
    scheme: Scheme | None = None,
) -> ExpertStore:
    """The store of a checkpoint directory (or file) with its experts in ``fmt``: reused if it
    exists, else read once (``scheme``: how the checkpoint stores quantized weights, see
    ``fill_from_safetensors``; experts run in another format are converted while the store fills)."""
    files, fmt = checkpoint_files(path), as_format(fmt)
    return ExpertStore.open_or_create(
        StoreIdentity.checkpoint(path, fmt),
        BankLayout.experts(geometry, fmt),
        lambda store: fill_from_safetensors(store, files, styles, layers, scheme),
        shm_dir,
    )


def open_dummy_experts(geometry: ExpertGeometry, seed: int, fmt: ExpertFormat | torch.dtype,
                       shm_dir: str | Path = SHM_DIR) -> ExpertStore:
    """Seeded random experts in format ``fmt`` (fp8: drawn in float32 and quantized; 4-bit: random
    codes under one quantized draw's scales, ``store_quantize.fill_dummy_fp4``)."""
    fmt = as_format(fmt)
    fill = {"float": fill_dummy, "fp8": fill_dummy_fp8}.get(fmt.family, fill_dummy_fp4)
    return ExpertStore.open_or_create(
        StoreIdentity.dummy(geometry, seed, fmt), BankLayout.experts(geometry, fmt), lambda s: fill(s, seed), shm_dir
    )
