"""Registers, spills and shared memory of the decode attention's partial kernels as compiled on this
GPU, at qwen3-30b's shapes (32 query heads, 4 KV heads, head dim 128, bf16, pages of 16):
``decode_partial_kernel`` and ``decode_rope_partial_kernel`` (RoPE inside) at each warp count given.

    python scripts/attention_regs.py [--rope-warps 4 8]

Needs a CUDA device (the compiler's figures are the ones this card runs).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.test_decode_rope import rope_case  # noqa: E402
from worker.attention import decode_kernel, triton_decode  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rope-warps", type=int, nargs="+", default=[triton_decode.ROPE_WARPS])
    args = parser.parse_args()
    config = (1, 32, 4, 128, 16, 64, True, 0, False)  # tests.test_decode_rope's CONFIGS layout
    q, k, k_cache, v_cache, table, lens, rope = rope_case(torch.Generator().manual_seed(0), config, torch.bfloat16,
                                                          "cuda")
    rotated, _ = rope.apply(q, k)
    triton_decode.paged_decode_attention(rotated, k_cache, v_cache, table, lens, 0.1)
    for warps in args.rope_warps:
        triton_decode.ROPE_WARPS = warps
        triton_decode.paged_decode_attention(q, k_cache, v_cache, table, lens, 0.1, rope=rope, k=k)
    torch.cuda.synchronize()
    for name in ("decode_partial_kernel", "decode_rope_partial_kernel"):
        for cache in getattr(decode_kernel, name).device_caches.values():
            for compiled in cache[0].values():
                print(f"{name:28s} warps {compiled.metadata.num_warps:2d}  registers {compiled.n_regs:3d}  "
                      f"spills {compiled.n_spills}  shared {compiled.metadata.shared}")


if __name__ == "__main__":
    main()
