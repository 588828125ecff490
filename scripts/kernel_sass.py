"""Compile the expert GEMM's decode and 4-bit kernels (and, as bf16's ``gemv_qkv``, the one-row qkv projection
of ``worker/models/linear.py``) for a GPU architecture on a machine without one, and
print what the compiler made of each: registers, shared memory, spills, instructions, and the
global loads and copies by width. Device time is scarce; this shows, before any run, whether a
change vectorises a weight stream or costs registers (occupancy). It measures nothing.

    python scripts/kernel_sass.py [--arch 90] [--formats nvfp4 mxfp4 fp8] [--kernels down_slot ...]
    python scripts/kernel_sass.py --against docs/sweeps/h200_fp8_one_token_sweep.json --unweighted

Arguments get the specialisation a launch gives them at qwen3-30b's shapes (pointers 16-byte
aligned, integers divisible by 16 where they are, an integer 1 a constant), unless the kernel marks
them ``do_not_specialize``.
Triton's own ptxas, cuobjdump and nvdisasm do the work; the Triton here may differ from the GPU
machine's, so the counts are a guide, and the benchmarks decide.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # compile, not interpret
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from moe_offload.kernels import grouped_gemm_w4 as prefill  # noqa: E402
from moe_offload.kernels import grouped_gemm_decode as decode_bf16  # noqa: E402
from moe_offload.kernels import grouped_gemm_decode_fp8 as decode_fp8  # noqa: E402
from moe_offload.kernels import grouped_gemm_w4_decode as decode  # noqa: E402
from moe_offload.kernels.grouped_gemm_w4_banks import GROUP  # noqa: E402
from moe_offload.kernels.triton_support import reg_cap  # noqa: E402
from scripts.bench_grouped_gemm_w4 import GEOMETRIES  # noqa: E402
from worker.models import linear as gemv  # noqa: E402

# element types of the kernels' pointer arguments (the scale banks' depend on the format)
POINTERS = dict(x_ptr="bf16", act_ptr="bf16", out_ptr="bf16", pair_out_ptr="bf16", q_ptr="i32", ids_ptr="i32",
                slots_ptr="i32", weights_ptr="fp32", host13_ptr="i32", host2_ptr="i32", w2_ptr="i32",
                plan_src_ptr="i32", plan_dst_ptr="i32", count_ptr="i32", sorted_pairs_ptr="i32", total_ptr="i32",
                w13_ptr="fp8e4nv", s13_ptr="fp32", s2_ptr="fp32", w13_bytes_ptr="u8",
                w2_bytes_ptr="u8", w_ptr="bf16", res_ptr="bf16", norm_ptr="bf16", sum_ptr="bf16", bias_ptr="bf16")
# the shapes the 4-bit benchmark times (``--geometry`` picks one; qwen3-30b's by default)
HIDDEN, INTER, EXPERTS, TOP_K = (GEOMETRIES["qwen3-30b"][k] for k in ("hidden", "inter", "experts", "top_k"))
FILL = False  # ``--fill``: the one-token and slot gate_ups compiled with a fill's copies (a plan of 8 rows)


def use_geometry(name: str, fill: bool) -> None:
    """Compile at ``name``'s shapes (``GEOMETRIES``) from now on, with a fill if ``fill``."""
    global HIDDEN, INTER, EXPERTS, TOP_K, FILL
    HIDDEN, INTER, EXPERTS, TOP_K = (GEOMETRIES[name][k] for k in ("hidden", "inter", "experts", "top_k"))
    FILL = fill


def fill_consts(cfg) -> dict:
    """A gate_up's fill constexprs (``fill_args``'s), PDL off."""
    return dict(FILL=FILL, PLAN=8 if FILL else 1, FILL_ROWS=cfg.fill_rows, FILL_K=cfg.fill_k, PDL=False)


LOAD_OPS = re.compile(r"\b((?:LDG|LDGSTS|STG)[.A-Z0-9]*)\b")
# an instruction's opcode after its address comment and any predicate (``@!P0``)
OPCODE = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)")


KERNELS = ("gate_up_pair", "down_token", "gate_up_slot", "down_slot", "prefill_gate_up", "prefill_down", "gemv_qkv")
ONE_TOKEN = ("gate_up_pair", "down_token")


def kernels(cfg=decode.W4_DECODE_TILES, pcfg=prefill.default_config(16, torch.bfloat16)) -> dict:
    """name -> (kernel, its constexprs, warps, stages, bank: w13 [2I, H] or w2 [H, I])."""
    act = dict(GPT_OSS=False, LIMIT=7.0, ALPHA=1.702)
    nofill = fill_consts(cfg)
    even = dict(EVEN_K=True)
    return {
        "gate_up_pair": (decode._gate_up_pair_w4_kernel, dict(TOP_K=TOP_K, HIDDEN=HIDDEN, BLOCK_N=cfg.pair_n,
                                                              BLOCK_K=cfg.pair_k, **act, **nofill), cfg.pair_warps, 3,
                         "w13"),
        # the down with PDL, as served: without it EARLY moves no read past the wait
        "down_token": (decode._down_token_w4_kernel, dict(TOP_K=TOP_K, INTER=INTER, BLOCK_N=cfg.down_n,
                                                          BLOCK_K=cfg.down_k, PDL=True, WEIGHTED=True,
                                                          EARLY=bool(cfg.down_early)),
                       cfg.down_warps, 3, "w2"),
        "gate_up_slot": (decode._gate_up_slot_w4_kernel, dict(BLOCK_P=16, BLOCK_N=cfg.gate_up_n, BLOCK_K=cfg.gate_up_k,
                                                              **act, **nofill, **even), cfg.num_warps, cfg.num_stages,
                         "w13"),
        "down_slot": (decode._down_slot_w4_kernel, dict(BLOCK_P=16, BLOCK_N=cfg.slot_down_n, BLOCK_K=cfg.slot_down_k,
                                                        PDL=False, **even), cfg.num_warps, cfg.num_stages, "w2"),
        "prefill_gate_up": (prefill._gate_up_w4_kernel, dict(BLOCK_M=pcfg.block_m, BLOCK_N=pcfg.block_n // 2,
                                                             BLOCK_K=pcfg.block_k, GROUP_M=pcfg.group_m, **act, **even),
                            pcfg.num_warps, pcfg.num_stages, "w13"),
        "prefill_down": (prefill._down_w4_kernel, dict(BLOCK_M=pcfg.block_m, BLOCK_N=pcfg.block_n, BLOCK_K=pcfg.block_k,
                                                       GROUP_M=pcfg.group_m, **even), pcfg.num_warps, pcfg.num_stages,
                         "w2"),
    }


def fp8_kernels(cfg=decode_fp8.FP8_DECODE_TILES, weighted: bool = True) -> dict:
    """The fp8 decode path's one-token kernels at the releases' 128 x 128 scale blocks (mode "k");
    ``weighted=False``: the down as 2 to 4 tokens run it (bf16 act rows, weighed in the down)."""
    nofill = fill_consts(cfg)
    scales = dict(SCALE_ROWS=128, SCALE_COLS=128, MODE="k")
    return {
        "gate_up_pair": (decode_fp8._pair_gate_up_fp8_kernel,
                         dict(TOP_K=TOP_K, HIDDEN=HIDDEN, BLOCK_N=cfg.pair_n, BLOCK_K=cfg.pair_k, **scales, **nofill,
                              EVEN=HIDDEN % cfg.pair_k == 0 and INTER % cfg.pair_n == 0), cfg.pair_warps, 3, "w13"),
        "down_token": (decode_fp8._down_fp8_kernel,
                       dict(TOP_K=TOP_K, INTER=INTER, BLOCK_N=cfg.down_n, BLOCK_K=cfg.down_k, PDL=True,
                            WEIGHTED=weighted, EARLY=bool(cfg.down_early), **scales,
                            EVEN=INTER % cfg.down_k == 0 and HIDDEN % cfg.down_n == 0),
                       cfg.down_warps, 3, "w2"),
    }


def bf16_kernels(cfg=decode_bf16.DecodeConfig()) -> dict:
    """The bf16 decode path's one-token kernels, the rate the others are held to per byte, and the
    one-row qkv projection (``worker/models/linear.py``: the norm and a bias inside, its default
    tiles at the geometry's hidden size)."""
    nofill = fill_consts(cfg)
    plain = dict(EVEN=True, BIAS=False, GPT_OSS=False, LIMIT=7.0, ALPHA=1.702)
    tiles = gemv.gemv_tiles(HIDDEN)
    qkv = dict(K=HIDDEN, BLOCK_N=gemv.BLOCK_N, BLOCK_K=tiles.block_k, BLOCK_ROW=triton.next_power_of_2(HIDDEN),
               EVEN_N=True, EVEN_K=HIDDEN % tiles.block_k == 0, NORM=True, RESIDUAL=True, GATED=False, BIAS=True,
               WHOLE=False, PDL=False)
    return {
        "gemv_qkv": (gemv._kernel(), qkv, tiles.warps, 3, "w13"),
        "gate_up_pair": (decode_bf16._decode_gate_up_pair_kernel, dict(TOP_K=TOP_K, HIDDEN=HIDDEN, BLOCK_N=cfg.pair_n,
                                                                       BLOCK_K=cfg.pair_k, **plain, **nofill),
                         cfg.pair_warps, 3, "w13"),
        "down_token": (decode_bf16._decode_down_kernel, dict(TOP_K=TOP_K, INTER=INTER, BLOCK_N=cfg.down_n,
                                                             BLOCK_K=cfg.down_k, EVEN=True, BIAS=False, PDL=False,
                                                             WEIGHTED=True),
                       cfg.down_warps, 3, "w2"),
    }


def launch_values(fmt: str, bank: str) -> dict:
    """The integer arguments' values at the real shapes (strides of the weights and their scales)."""
    rows, k = (2 * INTER, HIDDEN) if bank == "w13" else (HIDDEN, INTER)
    values = dict(num_slots=EXPERTS, hidden=HIDDEN, inter=INTER, stride_xt=HIDDEN, stride_xh=1, num_bias=1, stride_b=1,
                  top_k=TOP_K, stride_h13=2 * INTER * HIDDEN // 8, stride_h2=HIDDEN * INTER // 8,
                  stride_w2s=HIDDEN * INTER // 8,
                  plan_len=8, stride_cs=rows, stride_ws=rows * k, up_scale_row=INTER // 128)
    if fmt == "bf16":  # w13 [S, 2I, H] strides (ws, wn, wh); w2 [S, H, I] strides (ws, wh, wi)
        strides = dict(stride_wn=HIDDEN, stride_wh=1) if bank == "w13" else dict(stride_wh=INTER, stride_wi=1)
        return dict(values, **strides, stride_h13=2 * INTER * HIDDEN, stride_h2=HIDDEN * INTER,
                    stride_w2s=HIDDEN * INTER)
    if fmt == "fp8":  # e4m3 bytes, float32 scales of 128 x 128 blocks
        return dict(values, stride_ss=rows * k // 128 ** 2, stride_sr=k // 128, stride_h13=2 * INTER * HIDDEN,
                    stride_h2=HIDDEN * INTER, stride_w2s=HIDDEN * INTER)
    g = GROUP[fmt]  # int32 words of 8 codes, a scale byte per group
    return dict(values, stride_qs=rows * k // 8, stride_qn=k // 8, stride_ss=rows * k // g, stride_sn=k // g)


def source(fn, fmt: str, consts: dict, bank: str, one_token: bool) -> ASTSource:
    """The kernel with its constexprs and the divisibility hints a launch would give its arguments
    (``one_token``: one token's kernels, whose act rows are float32, weighted by the gate_up)."""
    scale = "fp8e4nv" if fmt == "nvfp4" else "u8"
    types = {name: "*" + t for name, t in POINTERS.items()} | dict(eps="fp32")
    if one_token:
        types.update(act_ptr="*fp32")
    if fmt == "fp8":
        types.update(w2_ptr="*fp8e4nv")
    if fmt == "bf16":
        types.update(w13_ptr="*bf16", w2_ptr="*bf16", host13_ptr="*bf16", host2_ptr="*bf16", b13_ptr="*bf16",
                     b2_ptr="*bf16")
    types.update(s_ptr=f"*{scale}", c_ptr="*fp32" if fmt == "nvfp4" else f"*{scale}", b_ptr=f"*{scale}")
    consts = {**dict(GROUP=GROUP.get(fmt), E8M0=fmt == "mxfp4", CHANNEL=fmt == "nvfp4", BIAS=False,
                     PRECISION="tf32"), **consts}
    names = fn.arg_names
    unhinted = {names[i] if isinstance(i, int) else i
                for i in (*(fn.do_not_specialize or ()), *(fn.do_not_specialize_on_alignment or ()))}
    values = launch_values(fmt, bank)
    # a launch compiles an integer argument that is 1 as the constant 1 (strides of 1: contiguity)
    consts.update({name: 1 for name in names if values.get(name) == 1 and name not in unhinted})
    signature, attrs = {}, {}
    for i, name in enumerate(names):
        signature[name] = "constexpr" if name in consts else types.get(name, "i32")
        pointer = signature[name].startswith("*")
        aligned = pointer or values.get(name, 1) % 16 == 0
        if name not in consts and name not in unhinted and aligned:
            attrs[(i,)] = [["tt.divisibility", 16]]
    return ASTSource(fn, signature, constexprs={k: v for k, v in consts.items() if k in names}, attrs=attrs)


def disassemble(compiled) -> tuple[str, str]:
    """The cubin's resource usage (cuobjdump) and its SASS (nvdisasm)."""
    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        usage = subprocess.run([tools / "cuobjdump", "-res-usage", cubin.name], capture_output=True, text=True).stdout
        sass = subprocess.run([tools / "nvdisasm", "-c", cubin.name], capture_output=True, text=True).stdout
    return usage, sass


def summary(usage: str, sass: str, warps: int) -> str:
    """Registers / shared bytes / spill stores, instructions, and loads by width."""
    regs = re.search(r"REG:(\d+).*?SHARED:(\d+).*?LOCAL:(\d+)", usage, re.S)
    instructions = len(re.findall(r"/\*[0-9a-f]{4,}\*/", sass))
    loads = ", ".join(f"{op} {n}" for op, n in sorted(Counter(LOAD_OPS.findall(sass)).items()))
    per_sm = min(65536 // (max(int(regs[1]), 1) * 32 * warps), 64 // warps)  # register file, warp slots
    return (f"regs {regs[1]:>3}  shared {regs[2]:>5}  local {regs[3]:>3}  programs/SM {per_sm:2d}  "
            f"instructions {instructions:5d}  {loads}")


def top_opcodes(sass: str, count: int) -> str:
    """The ``count`` most frequent opcodes (``FFMA 96``: a thread's, static), or nothing for 0."""
    opcodes = Counter(op.split(".")[0] for op in OPCODE.findall(sass)).most_common(count)
    return "  ops: " + ", ".join(f"{op} {n}" for op, n in opcodes) if count else ""


LABEL = re.compile(r"^\s*(\.L_x_\d+):")
ADDRESS = re.compile(r"/\*([0-9a-f]{4,})\*/")
BRANCH = re.compile(r"\bBRA\b.*?(\.L_x_\d+)")


def loop_body(sass: str) -> str:
    """The longest loop's body (the instructions from a label to a branch back to it): what a
    kernel's K loop issues each step, where ``summary``'s static count also holds its prologue and
    epilogue, run once."""
    labels, pending, lines = {}, None, []
    for line in sass.splitlines():
        if label := LABEL.match(line):
            pending = label[1]
        elif address := ADDRESS.search(line):
            lines.append((int(address[1], 16), line))
            if pending:
                labels[pending], pending = lines[-1][0], None
    spans = [(labels[target[1]], address) for address, line in lines
             if (target := BRANCH.search(line)) and labels.get(target[1], address) < address]
    start, end = max(spans, key=lambda span: span[1] - span[0], default=(0, -1))
    return "\n".join(line for address, line in lines if start <= address <= end)


def compile_line(kind: tuple, name: str, fmt: str, target: GPUTarget, regs: int = 0) -> tuple[str, str]:
    """One kernel of a ``kernels()``-style table compiled: its ``summary`` line (with the per-KB
    column for one token's kernels) and its SASS, its registers capped at ``regs`` (0: none)."""
    fn, consts, warps, stages, bank = kind
    one_token = name in ONE_TOKEN and consts.get("WEIGHTED", True)  # float32 act rows
    cap = reg_cap(regs)
    compiled = triton.compile(source(fn, fmt, consts, bank, one_token), target=target,
                              options=dict(num_warps=warps, num_stages=stages, **cap))
    usage, sass = disassemble(compiled)
    line = summary(usage, sass, warps)
    return line + per_weight_kb(line, warps, name, fmt, consts), sass


# a ``bench_grouped_gemm.py --fp8-decode-sweep`` row's config, by part: the DecodeConfig fields and the kernel
SWEEP_PARTS = {"gate_up": (("pair_n", "pair_k", "pair_warps", "pair_regs"), "gate_up_pair"),
               "down": (("down_n", "down_k", "down_warps"), "down_token")}


def against(path: Path, weighted: bool, target: GPUTarget) -> None:
    """Each one-token fp8 tile a ``bench_grouped_gemm.py --fp8-decode-sweep --json`` file timed,
    compiled here: its time beside warp instructions per KB, registers and warps an SM holds, and
    per part Pearson's r of the time with each (the counts are this tree's: pair a file with the
    tree it was timed on, ``--unweighted`` for a down timed before the weighted act rows)."""
    table = []
    for row in json.loads(path.read_text())["sweep"]:
        fields, name = SWEEP_PARTS.get(row["variant"], ((), ""))
        if len(row["config"]) != len(fields):  # another part, or tiles this tree no longer has
            continue
        tiles = dict(zip(fields, row["config"]))
        kind = fp8_kernels(decode_fp8.FP8_DECODE_TILES._replace(**tiles), weighted)[name]
        line, _ = compile_line(kind, name, "fp8", target, tiles.get("pair_regs", 0))
        warps = int(re.search(r"programs/SM\s+(\d+)", line)[1]) * kind[2]
        table.append((row["variant"], row["time_us"], field_of(line, "warp-instr/KB"), field_of(line, "regs"), warps,
                      row["config"]))
    for part in SWEEP_PARTS:
        rows = sorted((r for r in table if r[0] == part), key=lambda r: r[1])  # fastest first
        print(f"{part}: us  warp-instr/KB  regs  warps/SM  tiles")
        for _, us, per_kb, regs, warps, tiles in rows:
            print(f"  {us:6.1f}  {per_kb:6.0f}  {regs:4.0f}  {warps:3d}  {tiles}")
        print_correlations(rows, "")
        uncapped = [r for r in rows if len(r[5]) < 4 or r[5][3] == 0]  # the gate_up's fourth field: a register cap
        if len(uncapped) < len(rows):
            print_correlations(uncapped, " (no register cap)")


def print_correlations(rows: list[tuple], label: str) -> None:
    """Pearson's r of ``against``'s rows' times with their warp instructions per KB and warps an SM."""
    if len(rows) > 2:
        times = [r[1] for r in rows]
        print(f"  r(us, warp-instr/KB) {statistics.correlation(times, [r[2] for r in rows]):+.2f}  "
              f"r(us, warps/SM) {statistics.correlation(times, [r[4] for r in rows]):+.2f}  over {len(rows)}{label}")


def field_of(line: str, name: str) -> float:
    return float(re.search(rf"{re.escape(name)}\s+([\d.]+)", line)[1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 90 (H100/H200)")
    p.add_argument("--formats", nargs="+", default=["nvfp4", "mxfp4", "fp8", "bf16"],
                   choices=[*sorted(GROUP), "fp8", "bf16"])
    p.add_argument("--pair-regs", type=int, default=0, metavar="N",
                   help="cap one token's gate_up at N registers (DecodeConfig.pair_regs; 0: none)")
    p.add_argument("--geometry", default="qwen3-30b", choices=list(GEOMETRIES), help="the shapes compiled for")
    p.add_argument("--fill", action="store_true", help="the gate_ups with a fill's copies from the host")
    p.add_argument("--kernels", nargs="+", default=list(KERNELS), choices=KERNELS,
                   help="fp8 and bf16 have gate_up_pair and down_token (their one-token kernels); bf16 gemv_qkv")
    p.add_argument("--ops", type=int, default=0, metavar="N", help="also each kernel's N most frequent opcodes")
    p.add_argument("--loop", action="store_true",
                   help="also the longest loop's instructions a step (and with --ops its opcodes): a K loop's cost")
    p.add_argument("--prefill-tokens", type=int, default=16, metavar="T",
                   help="the 4-bit prefill kernels on the tiles a batch of T tokens takes (default_config)")
    p.add_argument("--tiles", nargs="+", default=[], metavar="FIELD=N",
                   help="decode tiles changed from the format's (W4_DECODE_TILES, FP8_DECODE_TILES; DecodeConfig "
                        "fields), e.g. down_warps=4")
    p.add_argument("--against", type=Path, metavar="JSON",
                   help="instead: each one-token fp8 tile a bench_grouped_gemm.py --fp8-decode-sweep --json file "
                        "timed, its time beside its compiled counts")
    p.add_argument("--unweighted", action="store_true",
                   help="with --against: the down as it ran before the weighted act rows (bf16 rows weighed in it)")
    args = p.parse_args()
    use_geometry(args.geometry, args.fill)
    target = GPUTarget("cuda", args.arch, 64 if args.arch < 100 else 32)
    if args.against:
        return against(args.against, not args.unweighted, target)
    changes = {field: int(value) for field, value in (item.split("=", 1) for item in args.tiles)}
    pcfg = prefill.default_config(args.prefill_tokens, torch.bfloat16)
    for fmt in args.formats:
        kinds, down_regs = format_kernels(fmt, changes, pcfg)
        for name in [k for k in args.kernels if k in kinds]:
            cap = {"gate_up_pair": args.pair_regs, "down_token": down_regs}
            line, sass = compile_line(kinds[name], name, fmt, target, cap.get(name, 0))
            print(f"{fmt:6} {name:16} {line}{top_opcodes(sass, args.ops)}")
            if args.loop and (body := loop_body(sass)):
                count = len(ADDRESS.findall(body))
                print(f"{'':6} {'  its loop':16} instructions {count:5d}{top_opcodes(body, args.ops)}")


def format_kernels(fmt: str, changes: dict, pcfg) -> tuple[dict, int]:
    """``fmt``'s kernels at the tiles it is served with (a 4-bit format's per ``decode.decode_tiles``:
    mxfp4's long down) changed by ``changes``, and the per-token down's register cap."""
    if fmt == "bf16":
        return bf16_kernels(), 0
    if fmt == "fp8":
        return fp8_kernels(decode_fp8.FP8_DECODE_TILES._replace(**changes)), 0
    tiles = decode.decode_tiles(fmt, INTER)._replace(**changes)
    return kernels(tiles, pcfg), tiles.down_regs


def per_weight_kb(line: str, warps: int, name: str, fmt: str, consts: dict) -> str:
    """One token's kernels (gate_up, down) from their ``summary`` line: warp instructions per KB of
    weights a program reads (static: the reductions are unrolled), the rate at which it can issue
    what its bytes ask."""
    if name not in ONE_TOKEN:
        return ""
    instructions = int(re.search(r"instructions\s+(\d+)", line)[1])
    rows = 2 * HIDDEN if name == "gate_up_pair" else TOP_K * INTER  # a column's weights
    weight_bytes = consts["BLOCK_N"] * rows * dict(bf16=2, fp8=1).get(fmt, 0.5)  # 4-bit: scales not counted
    return f"  warp-instr/KB {instructions * warps * 1024 / weight_bytes:.0f}"


if __name__ == "__main__":
    main()
