"""Fixed-shape Triton kernels of the offload path, one file each: the kernel, its eager torch twin
(the CPU path and the parity oracle) and the public op that picks between them. Triton is imported
lazily inside the ops, so this package imports without it.

May import: torch and triton only.
"""
