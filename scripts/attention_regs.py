"""Registers, spills and shared memory of the decode attention's partial kernels as compiled on this
GPU, at qwen3-30b's shapes (32 query heads, 4 KV heads, head dim 128, bf16, pages of 16):
``decode_partial_kernel`` and ``decode_rope_partial_kernel`` (RoPE inside) at each warp count given.

    python scripts/attention_regs.py [--rope-warps 4 8] [--arch 90]

Needs a CUDA device (the compiler's figures are the ones this card runs). Without one, ``--arch
90`` compiles ``decode_partial_kernel`` for that architecture here (Triton's own ptxas and
nvdisasm, as ``scripts/kernel_sass.py`` does) over a bf16 pool and a float8 one read as bytes and
as words (``triton_decode.FP8_WORDS``; widened by ``cvt``, and as "fp8 casts" by Triton's casts, as
on GPUs before sm89), each at its served tokens a step, and prints what one step of its loop
issues: instructions, byte-wide shared-memory loads (``LDS.U8``), ``ldmatrix``es, global loads to
registers (``LDG``) and to shared memory (``cp.async``, Triton's pipeline), and the kernel's waits
for those copies (how many may stay in flight: ``0x0``, none, where the pipeline keeps one buffer).
Then ``decode_rope_partial_kernel`` (qwen3's q/k norms, its index read before the PDL wait) over
the bf16 pool and the float8 words at their served warps: registers, spills and instructions of the
kernel.
It measures nothing; the benchmarks decide.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
from collections import Counter
from pathlib import Path

import torch

os.environ.pop("TRITON_INTERPRET", None)  # compile, not interpret
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from worker.attention import decode_kernel, triton_decode  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, PAGE = 32, 4, 128, 16
# the arguments a launch at these shapes gives 16-byte alignment or a multiple of 16 (the table and
# lens pointers are not specialised on alignment; the others vary)
ALIGNED = ("q_ptr", "k_ptr", "v_ptr", "sink_ptr", "m_ptr", "l_ptr", "acc_ptr", "out_ptr", "out_stride_b",
           "out_stride_h", "q_stride_b", "q_stride_h", "stride_page", "stride_tok", "stride_head")


def on_this_gpu(rope_warps: list[int]) -> None:
    from tests.test_decode_rope import rope_case

    config = (1, HEADS, KV_HEADS, HEAD_DIM, PAGE, 64, True, 0, False)  # tests.test_decode_rope's CONFIGS layout
    q, k, k_cache, v_cache, table, lens, rope = rope_case(torch.Generator().manual_seed(0), config, torch.bfloat16,
                                                          "cuda")
    rotated, _ = rope.apply(q, k)
    triton_decode.paged_decode_attention(rotated, k_cache, v_cache, table, lens, 0.1)
    for warps in rope_warps:
        triton_decode.ROPE_WARPS = warps
        triton_decode.paged_decode_attention(q, k_cache, v_cache, table, lens, 0.1, rope=rope, k=k)
    torch.cuda.synchronize()
    for name in ("decode_partial_kernel", "decode_rope_partial_kernel"):
        for cache in getattr(decode_kernel, name).device_caches.values():
            for compiled in cache[0].values():
                print(f"{name:28s} warps {compiled.metadata.num_warps:2d}  registers {compiled.n_regs:3d}  "
                      f"spills {compiled.n_spills}  shared {compiled.metadata.shared}")


def compile_here(arch: int, pool: str, words: bool, cvt: bool):
    """``decode_partial_kernel`` compiled for ``arch`` over a pool of ``pool`` ("bf16" or "fp8e4nv"),
    read as words where ``words`` (widened by ``cvt`` where ``cvt``, else by Triton's casts)."""
    consts = dict(HEADS=HEADS, GROUP=HEADS // KV_HEADS, HEAD_DIM=HEAD_DIM, PAGE=PAGE, BLOCK_G=16, BLOCK_D=HEAD_DIM,
                  BLOCK_N=triton_decode.keys_a_step(words, HEAD_DIM), IEEE=False, HAS_SINK=False, PDL=False,
                  WORDS=words, CVT=cvt)
    return _compile(decode_kernel.decode_partial_kernel, arch, pool, consts, {}, ALIGNED, triton_decode.PARTIAL_WARPS)


def compile_rope_here(arch: int, pool: str):
    """``decode_rope_partial_kernel`` compiled for ``arch`` over a pool of ``pool`` (float8 read as
    words), at the served warps and stages."""
    words = pool != "bf16"
    consts = dict(HEADS=HEADS, GROUP=HEADS // KV_HEADS, HEAD_DIM=HEAD_DIM, PAGE=PAGE, BLOCK_G=16,
                  BLOCK_N=triton_decode.keys_a_step(words, HEAD_DIM), IEEE=False, HAS_SINK=False, HAS_NORM=True,
                  PDL=True, WORDS=words, CVT=words, EARLY=True)
    pointers = dict(k_new_ptr="*bf16", v_new_ptr="*bf16", loc_ptr="*i64", pos_ptr="*i64", cos_ptr="*fp32",
                    sin_ptr="*fp32", qw_ptr="*bf16", kw_ptr="*bf16", eps="fp32")
    aligned = (*ALIGNED, "k_new_ptr", "v_new_ptr", "cos_ptr", "sin_ptr", "qw_ptr", "kw_ptr", "k_stride_b", "v_stride_b")
    warps = triton_decode.FP8_ROPE_WARPS if words else triton_decode.ROPE_WARPS
    return _compile(decode_kernel.decode_rope_partial_kernel, arch, pool, consts, pointers, aligned, warps)


def _compile(fn, arch: int, pool: str, consts: dict, pointers: dict, aligned: tuple, warps: int):
    """``fn`` compiled for ``arch`` with ``consts``, the partial kernels' common pointers (K and V of
    ``pool``) plus ``pointers``, the ``aligned`` arguments hinted 16-divisible, at the served stages."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    types = dict(q_ptr="*bf16", k_ptr=f"*{pool}", v_ptr=f"*{pool}", table_ptr="*i32", lens_ptr="*i32",
                 sink_ptr="*fp32", m_ptr="*fp32", l_ptr="*fp32", acc_ptr="*fp32", out_ptr="*bf16", qk_scale="fp32",
                 **pointers)
    names = fn.arg_names
    signature = {name: "constexpr" if name in consts else types.get(name, "i32") for name in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(names) if name in aligned}
    source = ASTSource(fn, signature, constexprs={k: v for k, v in consts.items() if k in names}, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", arch, 32),
                          options=dict(num_warps=warps, num_stages=triton_decode.PARTIAL_STAGES))


def loop_step(sass: str) -> list[str]:
    """The instructions of the kernel's longest loop (from a label to the branch back to it)."""
    lines = sass.splitlines()
    labels = {m[1]: i for i, line in enumerate(lines) if (m := re.match(r"\s*\.(L_x_\d+):", line))}
    loops = [(labels[m[1]], i) for i, line in enumerate(lines)
             if (m := re.search(r"BRA\s+`?\(?\.(L_x_\d+)", line)) and labels.get(m[1], i) < i]
    first, last = max(loops, key=lambda span: span[1] - span[0])
    return [line for line in lines[first:last + 1] if re.search(r"/\*[0-9a-f]{4,}\*/", line)]


def here(arch: int) -> None:
    from kernel_sass import disassemble  # beside this script

    for label, pool, words, cvt in (("bf16 pool", "bf16", False, False), ("fp8 bytes", "fp8e4nv", False, False),
                                    ("fp8 words", "fp8e4nv", True, True), ("fp8 casts", "fp8e4nv", True, False)):
        compiled = compile_here(arch, pool, words, cvt)
        usage, sass = disassemble(compiled)
        step = loop_step(sass)
        ops = Counter(m[1] for line in step if (m := re.search(r"\b(LDS(?:M)?[.A-Z0-9]*)", line)))
        regs = re.search(r"REG:(\d+)", usage)[1]
        copies = sum("LDGSTS" in line for line in step)
        waits = sorted(set(re.findall(r"DEPBAR\.LE SB0, (0x[0-9a-f]+)", sass)), reverse=True)  # every loop's
        print(f"{label:10s} regs {regs:>3}  loop step: instructions {len(step):4d}  "
              f"LDS.U8 {ops['LDS.U8']:3d}  ldmatrix {sum(n for op, n in ops.items() if op.startswith('LDSM')):3d}  "
              f"LDG {sum(bool(re.search(r'LDG[.]', line)) for line in step):2d}  cp.async {copies:2d}  "
              f"kernel waits for copies left {','.join(waits) or '-'}  shared {compiled.metadata.shared}")
    for pool in ("bf16", "fp8e4nv"):
        usage, sass = disassemble(compile_rope_here(arch, pool))
        regs, stack = re.search(r"REG:(\d+)", usage)[1], re.search(r"STACK:(\d+)", usage)[1]
        instructions = len(re.findall(r"/\*[0-9a-f]{4,}\*/", sass))
        print(f"rope {'bf16 pool' if pool == 'bf16' else 'fp8 words'} regs {regs:>3}  "
              f"spills {stack}  instructions {instructions}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rope-warps", type=int, nargs="+", default=[triton_decode.ROPE_WARPS])
    parser.add_argument("--arch", type=int, default=0,
                        help="compile for this compute capability here, without a GPU (e.g. 90)")
    args = parser.parse_args()
    if args.arch:
        here(args.arch)
    else:
        on_this_gpu(args.rope_warps)


if __name__ == "__main__":
    main()
