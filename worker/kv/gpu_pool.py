"""The paged KV pool: fixed-size pages of K and V for every layer, handed out from a free list.

    k[layer] : [num_pages, page_size, kv_heads, head_dim]     (v alike)
    a token's slot = page * page_size + offset

Page 0 is reserved as a scratch page: padded page-table entries point at it, so gathers of padding
never address outside the pool.

The pool holds the model's dtype, or float8 e4m3 (``--kv-cache-dtype fp8``: half the bytes a
token). A float8 pool has no scale (1): a write saturates at +-448 and rounds to nearest even
(``to_kv``, and ``rope_tiles.to_kv`` in the kernels that write), and every read, the new
tokens' own keys included, sees the rounded values (``as_stored``), so the paths agree.
"""
from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
KV_DTYPES = {"auto": None, "fp8": FP8}  # --kv-cache-dtype; None: the model's dtype
FP8_MAX = 448.0  # float8_e4m3fn's largest finite value (rope_tiles.to_kv has its own literal)


def check_caches(k_cache: torch.Tensor, v_cache: torch.Tensor, dtype: torch.dtype) -> None:
    """The one rule of what a pool read or written as ``dtype`` may hold: that dtype or float8 e4m3,
    K and V alike (the kernels' checks and ``qk_rope``'s write call it)."""
    if k_cache.dtype not in (dtype, FP8) or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"the k/v caches must share the {dtype} they are read as, or both hold {FP8}; got "
                         f"{k_cache.dtype}, {v_cache.dtype}")


def to_kv(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` as a pool of ``dtype`` stores it (the kernels' ``rope_tiles.to_kv``)."""
    if dtype == FP8:
        return x.float().clamp(-FP8_MAX, FP8_MAX).to(dtype)
    return x.to(dtype)


def as_stored(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """What reading ``x`` back from a pool of ``dtype`` gives, in ``x``'s dtype."""
    return x if dtype == x.dtype else to_kv(x, dtype).to(x.dtype)


def write_slots(cache: torch.Tensor, loc: torch.Tensor, x: torch.Tensor) -> None:
    """``cache[loc] = x`` rounded to the cache's dtype; a float8 cache through a byte view (torch has
    no CPU ``index_copy_`` for float8)."""
    x = to_kv(x, cache.dtype)
    if cache.element_size() == 1:
        cache, x = cache.view(torch.uint8), x.view(torch.uint8)
    cache.index_copy_(0, loc, x)


class PagedPool:
    """Pages handed out from a free list, lowest first. Subclasses set ``_free`` and ``_label``."""

    _free: list[int]
    _label: str

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise MemoryError(f"{self._label}: {n} pages asked, {len(self._free)} free")
        pages = self._free[len(self._free) - n:][::-1]
        del self._free[len(self._free) - n:]
        return pages

    def free(self, pages: list[int]) -> None:
        self._free.extend(reversed(pages))

    def free_pages(self) -> set[int]:
        return set(self._free)


class KVPool(PagedPool):
    """K and V of ``dtype`` (the compute dtype, what attention reads them as), stored in ``kv_dtype``
    (default: the same)."""

    def __init__(self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, kv_dtype: torch.dtype | None = None):
        if num_pages < 2:
            raise ValueError(f"KV pool needs at least 2 pages (one is scratch), got {num_pages}")
        shape = (num_layers, num_pages, page_size, num_kv_heads, head_dim)
        self.dtype = dtype
        self.k = torch.zeros(shape, dtype=kv_dtype or dtype, device=device)
        self.v = torch.zeros(shape, dtype=kv_dtype or dtype, device=device)
        self.page_size = page_size
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, 0, -1))  # allocate() hands out low pages first
        self._label = "KV pool"

    @property
    def capacity(self) -> int:
        """Pages that can ever be allocated (all but the scratch page)."""
        return self.num_pages - 1

    @property
    def page_bytes(self) -> int:
        return 2 * self.k[:, 0].numel() * self.k.element_size()

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def layer_slots(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's K and V caches by token slot: ``[num_pages * page_size, kv_heads, head_dim]``."""
        return self.k[layer].flatten(0, 1), self.v[layer].flatten(0, 1)

    def store(self, layer: int, out_loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write new tokens' K/V ``[T, kv_heads, D]`` to their slots (device index, no host read).
        The model's forward writes them with its RoPE instead (``worker.models.rotary.KVWrite``)."""
        k_slots, v_slots = self.layer_slots(layer)
        write_slots(k_slots, out_loc, k)
        write_slots(v_slots, out_loc, v)
