"""Paged prefill attention in Triton: flash attention over the KV pool's pages, GQA-packed, causal
aligned bottom-right, so a chunk attends over its cached prefix without any gather or mask tensor.

The chunks of a step are packed in ``q [T, heads, D]``; row b's ``q_lens[b]`` queries are the last
tokens of its ``seq_lens[b]`` (its new K/V are already in the pool). A program takes BLOCK_M query
tokens of one row and every query head of one KV head, so each K/V tile loaded from the pages
serves GROUP heads:

```
 keys of row b | 0 ............................ prefix+m0 | prefix+m0 .. prefix+m0+BLOCK_M |
               | visible to every query of the block: no  | the diagonal: causal mask      |
               | mask (whole BLOCK_N tiles)               | per query                      |
```

The grid is ``(blocks, kv_heads, splits)`` with the block list ``(row, first token, q_len, m0)`` built on
the host from ``q_lens`` (longest-running blocks first); loop bounds come from ``seq_lens`` on the
device, clamped to ``[q_len, max_pages * page]``, and page ids are clamped to the pool, so no value
read on the device can address outside a buffer. Nothing is read back on the host.

When the blocks are too few to fill the GPU (``split_count``, at launch, from the host prefixes the
block list was built with), the third grid dimension splits each block's keys
(``worker.attention.split_kv``): the splits share the mask-free tiles, the last one also takes the
diagonal, and a merge launch combines their partial outputs by log-sum-exp. Tiles come from a small
table by dtype and head dim (``TILES``), picked on the host; ``bench_prefill_attention.py --sweep``
times the alternatives.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from moe_offload.kernels.triton_support import interpreting, next_pow2, use_triton
from worker.attention.paged_checks import check_paged_inputs, check_sinks
from worker.attention.split_kv import MAX_SPLITS, merge_splits, multiprocessors, partial_buffers, split_count

_LOG2E = 1.4426950408889634


class PrefillTile(NamedTuple):
    """Defaults: the fastest of the tiles ``scripts/bench_prefill_attention.py --sweep`` tried on an
    H200 (32 query / 4 KV heads, head dim 128, bf16): 403-441 TFLOP/s against 300-340 for 128 rows."""

    rows: int = 256  # query rows (tokens x heads of one KV head) per program
    block_n: int = 64  # keys per inner step
    num_warps: int = 16
    num_stages: int = 2
    warp_specialize: bool = False  # Triton's automatic warp specialisation of the key loops (sm90+)
    qk_ahead: bool = False  # the mask-free loop scores the next tile before this tile's softmax


TILE = PrefillTile()
TILE_FP32 = PrefillTile(128, 64, 8, 3)  # 256 rows of float32 at head dim 128 need 263 KB of shared memory (H200: 227)
# (bytes per element, largest head dim, tile): the first line that holds the call is taken. Head
# dims past 128 halve the rows so that q and the K/V stages still fit in shared memory.
TILES = (
    (2, 128, TILE),
    (2, 256, PrefillTile(128, 64, 8, 2)),
    (4, 128, TILE_FP32),
    (4, 256, PrefillTile(64, 32, 4, 2)),
)


def tile_for(dtype: torch.dtype, head_dim: int = 128) -> PrefillTile:
    """The tile of ``TILES`` for ``dtype`` and ``head_dim``, picked on the host (no autotuning: the
    block list depends on the tile, and one list serves every layer of a step)."""
    for elem, max_d, tile in TILES:
        if dtype.itemsize <= elem and head_dim <= max_d:
            return tile
    raise ValueError(f"no prefill tile for {dtype} at head dim {head_dim} (largest: {TILES[-1][1]})")


def block_tokens(group: int, tile: PrefillTile = TILE) -> int:
    """Query tokens per program: ``tile.rows`` rows hold this many tokens of all ``group`` heads."""
    return max(tile.rows // next_pow2(group), 1)


class PrefillBlocks(NamedTuple):
    """The kernel's programs for one batch, on the device, with the host values they came from."""

    q_lens: tuple[int, ...]
    block_m: int
    table: torch.Tensor  # int32 [programs, 4]: row, its first token in q, its q_len, m0
    max_tiles: int = 0  # mask-free key tiles of the longest block, from host prefixes (0: unknown)
    splits: int | None = None  # key partitions per block; None: ``split_count`` at launch
    tile: PrefillTile = TILE  # the tile it was built for: a call without a tile takes this one


def prefill_blocks(q_lens: list[int], block_m: int, prefixes: list[int] | None = None) -> list[list[int]]:
    """``[row, first token in q, q_len, m0]`` per program, those with the most keys first (the
    longest programs start first, so the last wave is short)."""
    blocks, start = [], 0
    for b, n in enumerate(q_lens):
        blocks += [[b, start, n, m0] for m0 in range(0, n, block_m)]
        start += n
    prefixes = prefixes or [0] * len(q_lens)
    return sorted(blocks, key=lambda x: -(prefixes[x[0]] + x[3]))


def prefill_block_table(q_lens: list[int], group: int, device: torch.device, tile: PrefillTile = TILE,
                        prefixes: list[int] | None = None, splits: int | None = None) -> PrefillBlocks:
    """The block list of ``q_lens`` on ``device`` (one pinned, non-blocking copy); ``prefixes``
    (cached tokens per row, from the host) order it and size the split-KV choice; ``splits``
    forces a split count."""
    if splits is not None and not 1 <= splits <= MAX_SPLITS:
        raise ValueError(f"splits must be in [1, {MAX_SPLITS}]; got {splits}")
    block_m = block_tokens(group, tile)
    host = torch.tensor(prefill_blocks(q_lens, block_m, prefixes), dtype=torch.int32).view(-1, 4)
    table = host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host.to(device)
    longest = max(p + (n - 1) // block_m * block_m + 1 for p, n in zip(prefixes, q_lens)) if prefixes else 0
    return PrefillBlocks(tuple(q_lens), block_m, table, longest // tile.block_n, splits, tile)


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
                            seq_lens: torch.Tensor, q_lens: list[int], scale: float, *,
                            blocks: PrefillBlocks | None = None, tile: PrefillTile | None = None,
                            splits: int | None = None, backend: str | None = None,
                            sinks: torch.Tensor | None = None, window: int = 0) -> torch.Tensor:
    """``q [T, heads, D]`` (rows packed in order, ``q_lens`` from the host) over ``k_cache, v_cache
    [num_pages, page, kv_heads, D]`` (one layer, in q's dtype or float8 e4m3, whose tiles are
    widened to q's dtype before the MMAs) through ``page_table [B, max_pages]``; query i of row b
    sits at position ``seq_lens[b] - q_lens[b] + i`` and sees keys up to it. Returns ``[T, heads,
    D]`` in q's dtype. ``blocks`` (from ``prefill_block_table``) saves rebuilding the block list
    per layer and carries its tile and split-KV choice; without it ``splits`` (default 1) is used.
    ``tile`` (default: the blocks', else ``tile_for(q.dtype, D)``) is for tuning. CUDA tensors run
    the kernel, others the eager twin. gpt-oss: ``sinks [heads]`` (float32 logits in each
    denominator) and ``window`` (> 0: a query sees the ``window`` keys ending at its own)."""
    _check(q, k_cache, v_cache, page_table, seq_lens, q_lens)
    check_sinks(sinks, q)
    if not use_triton(q, backend):
        return paged_prefill_attention_eager(q, k_cache, v_cache, page_table, seq_lens, q_lens, scale, sinks, window)
    if not scale > 0:  # masked scores are -inf before the scale: -inf * 0 would be NaN
        raise ValueError(f"scale must be positive; got {scale}")
    if blocks is not None and splits is not None:
        raise ValueError("pass splits to prefill_block_table when passing blocks")
    group = q.shape[1] // k_cache.shape[2]
    tile = tile or (blocks.tile if blocks is not None else tile_for(q.dtype, q.shape[2]))
    if blocks is None:
        blocks = prefill_block_table(q_lens, group, q.device, tile, splits=splits or 1)
    block_m = block_tokens(group, tile)
    if blocks.q_lens != tuple(q_lens) or blocks.block_m != block_m or blocks.table.device != q.device:
        raise ValueError(f"blocks built for q_lens {blocks.q_lens[:8]} in {blocks.block_m}-token blocks on "
                         f"{blocks.table.device}; this call has {tuple(q_lens[:8])} in {block_m}-token blocks on {q.device}")
    n_splits = blocks.splits or split_count(blocks.table.shape[0] * k_cache.shape[2], blocks.max_tiles,
                                            multiprocessors(q.device))
    out = torch.empty_like(q)
    parts = partial_buffers(n_splits, q) if n_splits > 1 else None
    _launch(q, k_cache, v_cache, page_table, seq_lens, blocks, tile, scale, out, parts, sinks, window)
    return out if parts is None else merge_splits(*parts, out, backend="triton")


def _launch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
            seq_lens: torch.Tensor, blocks: PrefillBlocks, tile: PrefillTile, scale: float, out: torch.Tensor,
            parts: tuple[torch.Tensor, torch.Tensor] | None, sinks: torch.Tensor | None = None,
            window: int = 0) -> None:
    """One launch over ``(blocks, kv_heads, splits)``: into ``out``, or into the partial buffers."""
    T, heads, D = q.shape
    num_pages, page, kv_heads, _ = k_cache.shape
    group = heads // kv_heads
    part_o, part_lse = parts if parts is not None else (out, out)
    splits = part_o.shape[0] if parts is not None else 1
    _kernel()[(blocks.table.shape[0], kv_heads, splits)](
        q, k_cache, v_cache, out, part_o, part_lse, page_table, seq_lens, blocks.table,
        sinks if sinks is not None else seq_lens,  # unused without HAS_SINK
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), page_table.stride(0),
        num_pages, page_table.shape[1] * page, scale * _LOG2E, T, heads, splits, window,
        GROUP=group, BLOCK_G=next_pow2(group), HEAD_DIM=D, BLOCK_D=max(16, next_pow2(D)), PAGE=page,
        BLOCK_M=blocks.block_m, BLOCK_N=tile.block_n, IEEE=q.dtype == torch.float32,
        UPCAST=interpreting() and q.dtype == torch.bfloat16, WARP_SPECIALIZE=tile.warp_specialize,
        QK_AHEAD=tile.qk_ahead and not window, SPLIT=parts is not None, WINDOWED=window > 0,
        HAS_SINK=sinks is not None, num_warps=tile.num_warps, num_stages=tile.num_stages)


def paged_prefill_attention_eager(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                  page_table: torch.Tensor, seq_lens: torch.Tensor, q_lens: list[int],
                                  scale: float, sinks: torch.Tensor | None = None, window: int = 0) -> torch.Tensor:
    """The twin: per row, gather its pages (a float8 pool's widened, exactly), mask keys past each
    query's position (and before its window), softmax in float32 with each head's sink in the
    denominator, with the kernel's clamp of ``seq_lens`` (device arithmetic only, so it never syncs
    either)."""
    T, heads, D = q.shape
    num_pages, page, kv_heads, _ = k_cache.shape
    max_tokens = page_table.shape[1] * page
    group = heads // kv_heads
    key_pos = torch.arange(max_tokens, device=q.device)
    out, start = torch.empty_like(q), 0
    for b, n in enumerate(q_lens):
        pages = page_table[b].long().clamp(0, num_pages - 1)
        keys = k_cache[pages].reshape(max_tokens, kv_heads, D).float()
        values = v_cache[pages].reshape(max_tokens, kv_heads, D).float()
        seq_len = seq_lens[b].long().clamp(n, max_tokens)
        pos = seq_len - n + torch.arange(n, device=q.device)  # [n] absolute positions of the queries
        visible = (key_pos[None, :] <= pos[:, None]) & (key_pos[None, :] < seq_len)  # [n, S]
        if window:
            visible &= key_pos[None, :] > pos[:, None] - window
        qf = q[start:start + n].float().view(n, kv_heads, group, D)
        scores = torch.einsum("nkgd,skd->kgns", qf, keys) * scale
        probs = _softmax(scores.masked_fill(~visible, float("-inf")), sinks)
        o = torch.einsum("kgns,skd->nkgd", probs, values)
        out[start:start + n] = o.reshape(n, heads, D).to(q.dtype)
        start += n
    return out


def _softmax(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """Softmax over the last dim of ``[kv_heads, group, n, S]``, each head's sink in its denominator."""
    if sinks is None:
        return torch.softmax(scores, dim=-1)
    sink = sinks.float().view(*scores.shape[:2], 1, 1).expand(*scores.shape[:-1], 1)
    return torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]


def _check(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
           seq_lens: torch.Tensor, q_lens: list[int]) -> None:
    """Shapes and host lengths: the kernel does raw pointer arithmetic from them."""
    check_paged_inputs(q, k_cache, v_cache, page_table, seq_lens)
    B, max_tokens = page_table.shape[0], page_table.shape[1] * k_cache.shape[1]
    if len(q_lens) != B or seq_lens.shape[0] != B:
        raise ValueError(f"{len(q_lens)} q_lens and {seq_lens.shape[0]} seq_lens for a page table of {B} rows")
    if sum(q_lens) != q.shape[0]:
        raise ValueError(f"q_lens add up to {sum(q_lens)} tokens, q has {q.shape[0]}")
    if any(n < 1 or n > max_tokens for n in q_lens):
        raise ValueError(f"every q_len must be in [1, {max_tokens}] (the page table's tokens); got {q_lens}")


@functools.cache
def _kernel():
    import worker.attention.prefill_kernel as prefill_kernel  # imports triton: only when a kernel launches

    return prefill_kernel.prefill_kernel
