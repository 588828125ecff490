"""Filling an expert store: from a safetensors checkpoint, or with seeded random weights
(``--dummy-weights``, e.g. the qwen3-30b-geometry benchmark workload, which has no checkpoint)."""
from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Collection, NamedTuple, Sequence

import torch

from moe_offload.expert_store import SHM_DIR, ExpertStore
from moe_offload.progress import ProgressBar
from moe_offload.safetensors_file import SafetensorsFile, index_files
from moe_offload.fp8 import ExpertFormat
from moe_offload.store_layout import BankLayout, ExpertGeometry, StoreIdentity, as_format, checkpoint_files


class ExpertNames(NamedTuple):
    """Tensor-name templates of one checkpoint style, with ``{layer}`` and ``{expert}`` to fill in.
    A per-expert style names ``gate [I, H]``, ``up [I, H]`` and ``down [H, I]``; a fused style names
    ``gate_up [E, 2I, H]`` (gate rows, then up rows) and ``down [E, H, I]`` once per layer."""

    down: str
    gate: str | None = None
    up: str | None = None
    gate_up: str | None = None

    @property
    def probe(self) -> str:
        """The name whose presence identifies the style."""
        return self.gate_up or self.gate


_MIXTRAL = "model.layers.{layer}.block_sparse_moe.experts.{expert}."
_QWEN3_MOE = "model.layers.{layer}.mlp.experts.{expert}."
_FUSED = "model.layers.{layer}.mlp.experts."
MIXTRAL_NAMES = ExpertNames(down=_MIXTRAL + "w2.weight", gate=_MIXTRAL + "w1.weight", up=_MIXTRAL + "w3.weight")
QWEN3_MOE_NAMES = ExpertNames(
    down=_QWEN3_MOE + "down_proj.weight", gate=_QWEN3_MOE + "gate_proj.weight", up=_QWEN3_MOE + "up_proj.weight"
)
FUSED_NAMES = ExpertNames(down=_FUSED + "down_proj", gate_up=_FUSED + "gate_up_proj")  # transformers 5
CHECKPOINT_STYLES = (MIXTRAL_NAMES, QWEN3_MOE_NAMES, FUSED_NAMES)


def detect_names(tensor_names: Collection[str], layer: int, styles: Sequence[ExpertNames] = CHECKPOINT_STYLES) -> ExpertNames:
    for style in styles:
        if style.probe.format(layer=layer, expert=0) in tensor_names:
            return style
    tried = [style.probe.format(layer=layer, expert=0) for style in styles]
    raise ValueError(f"no expert weights for layer {layer} in the checkpoint; looked for {tried}")


def _read(index: dict[str, SafetensorsFile], name: str, shape: Sequence[int]) -> torch.Tensor:
    if name not in index:
        raise ValueError(f"missing tensor {name}")
    tensor = index[name].tensor(name)
    if tuple(tensor.shape) != tuple(shape):
        raise ValueError(f"tensor {name} has shape {tuple(tensor.shape)}, expected {tuple(shape)}")
    return tensor


def load_expert_layer(
    index: dict[str, SafetensorsFile], names: ExpertNames, layer: int, w13: torch.Tensor, w2: torch.Tensor
) -> None:
    """Copy checkpoint layer ``layer`` into ``w13 [E, 2I, H]`` and ``w2 [E, H, I]`` (any device/dtype)."""
    num_experts, two_i, hidden = w13.shape
    inter = two_i // 2
    if names.gate_up is not None:
        w13.copy_(_read(index, names.gate_up.format(layer=layer), w13.shape))
        w2.copy_(_read(index, names.down.format(layer=layer), w2.shape))
        return
    for e in range(num_experts):
        w13[e, :inter].copy_(_read(index, names.gate.format(layer=layer, expert=e), (inter, hidden)))
        w13[e, inter:].copy_(_read(index, names.up.format(layer=layer, expert=e), (inter, hidden)))
        w2[e].copy_(_read(index, names.down.format(layer=layer, expert=e), (hidden, inter)))


def fill_from_safetensors(
    store: ExpertStore,
    files: Sequence[str | Path],
    styles: Sequence[ExpertNames] = CHECKPOINT_STYLES,
    layers: Sequence[int] | None = None,
) -> None:
    """Fill ``w13``/``w2`` from a (sharded) checkpoint. ``layers[i]`` is the checkpoint layer of bank
    layer ``i`` (default: the same index), for models whose first layers are dense."""
    w13, w2 = store.bank("w13"), store.bank("w2")
    layers = list(range(w13.shape[0])) if layers is None else list(layers)
    if len(layers) != w13.shape[0]:
        raise ValueError(f"{len(layers)} checkpoint layers given for {w13.shape[0]} bank layers")
    index = index_files(list(files))
    names = detect_names(index.keys(), layers[0], styles)
    with ProgressBar(w13.nbytes + w2.nbytes, f"loading experts of {store.identity.label}") as bar:
        for i, layer in enumerate(layers):
            load_expert_layer(index, names, layer, w13[i], w2[i])
            bar.advance(w13[i].nbytes + w2[i].nbytes)


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
    checkpoint_format: ExpertFormat | None = None,
) -> ExpertStore:
    """The store of a checkpoint directory (or file) in expert format ``fmt``: reused if it exists,
    else read once. Float experts (``checkpoint_format`` None or a float format) stored as fp8 are
    quantized while the store is filled (``store_quantize``)."""
    from moe_offload.store_quantize import fill_quantized_from_safetensors  # it builds on this module

    files, fmt = checkpoint_files(path), as_format(fmt)
    quantize = fmt.quantized and not (checkpoint_format is not None and checkpoint_format.quantized)
    fill = fill_quantized_from_safetensors if quantize else fill_from_safetensors
    return ExpertStore.open_or_create(
        StoreIdentity.checkpoint(path, fmt),
        BankLayout.experts(geometry, fmt),
        lambda store: fill(store, files, styles, layers),
        shm_dir,
    )


def open_dummy_experts(geometry: ExpertGeometry, seed: int, fmt: ExpertFormat | torch.dtype,
                       shm_dir: str | Path = SHM_DIR) -> ExpertStore:
    """Seeded random experts in format ``fmt`` (fp8: drawn in float32 and quantized)."""
    from moe_offload.store_quantize import fill_dummy_fp8  # it builds on this module

    fmt = as_format(fmt)
    fill = fill_dummy_fp8 if fmt.quantized else fill_dummy
    return ExpertStore.open_or_create(
        StoreIdentity.dummy(geometry, seed, fmt), BankLayout.experts(geometry, fmt), lambda s: fill(s, seed), shm_dir
    )
