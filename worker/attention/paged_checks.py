"""Host-side checks shared by the paged attention kernels: they do raw pointer arithmetic, so
shapes, dtypes, strides and devices are checked from metadata before any launch."""
from __future__ import annotations

import torch

from worker.kv.gpu_pool import check_caches

FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def check_paged_inputs(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
                       seq_lens: torch.Tensor) -> None:
    """``q [rows, heads, D]``, one layer's ``k/v cache [pages, page, kv_heads, D]`` (q's dtype or
    float8 e4m3), ``page_table [B, max_pages]``, ``seq_lens [B]``; the callers check how rows relate
    to B."""
    if q.dim() != 3 or k_cache.dim() != 4 or page_table.dim() != 2 or seq_lens.dim() != 1:
        raise ValueError("expected q [rows, heads, D], k/v cache [pages, page, kv_heads, D], "
                         "page_table [B, max_pages], seq_lens [B]")
    heads, D = q.shape[1:]
    if v_cache.shape != k_cache.shape or v_cache.stride() != k_cache.stride() or k_cache.shape[3] != D:
        raise ValueError(f"k {tuple(k_cache.shape)} / v {tuple(v_cache.shape)} caches do not match q {tuple(q.shape)}")
    kv_heads = k_cache.shape[2]
    if kv_heads < 1 or heads % kv_heads:
        raise ValueError(f"{heads} query heads are not a multiple of {kv_heads} KV heads")
    if page_table.shape[1] < 1 or k_cache.shape[0] < 1:
        raise ValueError("the page table and the pool need at least one page")
    if q.dtype not in FLOATS:
        raise ValueError(f"q and the caches must share one of {FLOATS} (or the caches hold float8); got {q.dtype}")
    check_caches(k_cache, v_cache, q.dtype)
    if page_table.dtype not in (torch.int32, torch.int64) or seq_lens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"page_table and seq_lens must be int32/int64; got {page_table.dtype}, {seq_lens.dtype}")
    if q.stride(2) != 1 or k_cache.stride(3) != 1 or page_table.stride(1) != 1 or seq_lens.stride(0) != 1:
        raise ValueError("q, the caches, page_table rows and seq_lens must be contiguous in their last dimension")
    if page_table.shape[1] * k_cache.shape[1] >= 2**31:
        raise ValueError("a page table longer than 2^31 tokens overflows the kernel's token index")
    if len({t.device for t in (q, k_cache, v_cache, page_table, seq_lens)}) != 1:
        raise ValueError("q, the caches, page_table and seq_lens must be on one device")


def check_sinks(sinks: torch.Tensor | None, q: torch.Tensor) -> None:
    """gpt-oss's sink logits: float32 ``[heads]`` on q's device, contiguous (the kernels index them)."""
    if sinks is not None and (sinks.shape != (q.shape[1],) or sinks.dtype != torch.float32
                              or sinks.device != q.device or sinks.stride(0) != 1):
        raise ValueError(f"sinks must be float32 [{q.shape[1]}] on {q.device}; got {tuple(sinks.shape)} "
                         f"{sinks.dtype} on {sinks.device}")
