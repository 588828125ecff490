"""Paged KV storage and its page moves: the GPU pool (``gpu_pool``), the pinned host pool beside it
(``host_pool``, which moves pages to and from a GPU pool) and the fixed-shape copy kernels with
their eager twins (``page_copy``). The scheduler's tier decides which pages move and on which
stream; it launches nothing itself."""
