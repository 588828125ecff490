"""Split-KV for paged prefill: when a batch has too few query blocks to fill the GPU (a short chunk,
or decode-like rows, over a long prefix), each block's keys are cut into ``splits`` partitions that
run as separate programs; each writes its normalised partial output and log2-sum-exp, and a merge
launch combines them:

```
 keys of a block | split 0 | split 1 | ... | split n-1 + the diagonal |  (mask-free tiles shared out
                 | o_0, lse_0 | o_1, lse_1 | ... | o_n-1, lse_n-1      |   evenly, on the device)
 merge: out = sum_s 2^(lse_s - max lse) o_s / sum_s 2^(lse_s - max lse)
```

The split count is a grid dimension chosen on the host from the batch shape (``split_count``); the
partition bounds come from the device's ``seq_lens``, so stale host lengths cost balance, never
correctness.
"""
from __future__ import annotations

import functools
import math

import torch

from moe_offload.kernels.triton_support import next_pow2, use_triton

MAX_SPLITS = 128
MIN_TILES_PER_SPLIT = 4  # a shorter split costs more in its partial write and merge than it saves
MERGE_ROWS = 16  # (token, head) rows per merge program


def split_count(programs: int, key_tiles: int, sms: int, max_splits: int = MAX_SPLITS) -> int:
    """Splits for ``programs`` unsplit programs whose longest walks ``key_tiles`` mask-free key
    tiles, on ``sms`` SMs: FlashAttention-2's rule. A grid of 0.8 waves or more is left alone;
    else take the fewest splits whose last wave is within 85 % of the best fill, among counts that
    shorten the longest split."""
    if programs < 1 or sms < 1 or programs >= 0.8 * sms:
        return 1
    limit = max(1, min(max_splits, sms, key_tiles // MIN_TILES_PER_SPLIT))

    def fill(s: int) -> float:
        waves = programs * s / sms
        return waves / math.ceil(waves)

    useful = [s for s in range(1, limit + 1) if s == 1 or -(-key_tiles // s) != -(-key_tiles // (s - 1))]
    best = max(fill(s) for s in useful)
    return next(s for s in useful if fill(s) >= 0.85 * best)


@functools.cache
def multiprocessors(device: torch.device) -> int:
    """SMs of a CUDA device (a host query, no sync); other devices count as one, so they never split."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def partial_buffers(splits: int, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``part_o [splits, T, heads, D]`` and ``part_lse [splits, T, heads]``, float32; every entry is
    written by exactly one program (each token is in one block), so they need no clearing."""
    T, heads, D = q.shape
    if splits * T * heads >= 2**31:
        raise ValueError(f"{splits} splits of {T} tokens x {heads} heads overflow the merge's row index")
    part_o = torch.empty(splits, T, heads, D, dtype=torch.float32, device=q.device)
    return part_o, torch.empty(splits, T, heads, dtype=torch.float32, device=q.device)


def merge_splits(part_o: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor, *,
                 backend: str | None = None) -> torch.Tensor:
    """Combine the splits into ``out [T, heads, D]`` (any strides, last one 1) by their log2-sum-exp;
    CUDA tensors run the kernel, others the eager twin."""
    splits, T, heads, D = part_o.shape
    if part_lse.shape != (splits, T, heads) or out.shape != (T, heads, D) or out.stride(2) != 1:
        raise ValueError(f"partials {tuple(part_o.shape)} / {tuple(part_lse.shape)} do not match "
                         f"out {tuple(out.shape)}")
    if not (part_o.is_contiguous() and part_lse.is_contiguous()):
        raise ValueError("the partial buffers must be contiguous")
    if not use_triton(out, backend):
        out.copy_(merge_splits_eager(part_o, part_lse))
        return out
    rows = T * heads
    _merge_kernel()[(-(-rows // MERGE_ROWS),)](
        part_o, part_lse, out, rows, heads, splits, out.stride(0), out.stride(1),
        HEAD_DIM=D, BLOCK_D=max(16, next_pow2(D)), BLOCK_R=MERGE_ROWS, num_warps=4)
    return out


def merge_splits_eager(part_o: torch.Tensor, part_lse: torch.Tensor) -> torch.Tensor:
    """The twin: float32 ``[T, heads, D]``; the weights are the splits' softmax over base-2 lse."""
    weights = torch.softmax(part_lse * math.log(2), dim=0)  # 2^(lse_s) / sum_s 2^(lse_s)
    return (weights[..., None] * part_o).sum(0)


@functools.cache
def _merge_kernel():
    import worker.attention.prefill_kernel as prefill_kernel  # imports triton: only when a kernel launches

    return prefill_kernel.merge_kernel
