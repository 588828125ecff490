"""Mixture-of-Experts execution with experts that may live off the device: routing, the MoE layer
API the models call (route -> experts -> combine), the expert store, the GPU expert cache, and the
Triton kernels with their eager twins.

May import: torch and triton only (triton lazily, so the package imports on any platform).
"""
