"""Fixed-shape Triton kernels of the offload path, one file each: the kernel, its eager torch twin
(the CPU path and the parity oracle) and the public op that picks between them. Triton is imported
lazily inside the ops, so this package imports without it. ``triton_support`` holds the plumbing
they share (which path an op takes, block sizes, byte views); the worker's kernels use it too.
``decode_tiles`` holds the Triton pieces the three decode kernels share.

May import: torch and triton only.
"""
