"""scripts/kernel_sass.py compiles the decode and 4-bit kernels for sm90 on a machine without a GPU
and reads the cubin with Triton's own tools: registers, programs an SM holds, load widths; and
scripts/attention_regs.py --arch 90 the decode attention's partial kernel."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from worker.attention import triton_decode

ROOT = Path(__file__).resolve().parents[1]


def kernel_sass(*args: str, script: str = "scripts/kernel_sass.py") -> str:
    """The script's output (skipped where Triton carries no ptxas)."""
    bindir = Path(pytest.importorskip("triton").__file__).parent / "backends" / "nvidia" / "bin"
    if not (bindir / "ptxas").exists():
        pytest.skip("this Triton carries no ptxas")
    run = subprocess.run([sys.executable, script, *args], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    return run.stdout


def sass(*args: str) -> list[str]:
    return [line for line in kernel_sass(*args).splitlines() if "regs" in line]


def field(line: str, name: str) -> int:
    return int(line.split(name)[1].split()[0])


def test_the_per_slot_down_compiles_for_sm90_with_16_byte_weight_copies():
    (line,) = sass("--formats", "nvfp4", "--kernels", "down_slot")
    assert field(line, "regs") > 0 and field(line, "programs/SM") >= 1
    # nvfp4's 8-byte groups load as one run of a row's words where K is a multiple of the step
    assert "LDGSTS.E.BYPASS.128" in line and "LDGSTS.E.64" not in line, line


def test_a_register_cap_reaches_the_compiler_and_spills_nothing_at_128():
    """DecodeConfig.pair_regs goes to ptxas as maxnreg (triton_support.reg_cap): fp8's one-token
    gate_up takes more than 128 registers uncapped, one program an SM; capped, two and no spill."""
    (free,) = sass("--formats", "fp8", "--kernels", "gate_up_pair")
    (capped,) = sass("--formats", "fp8", "--kernels", "gate_up_pair", "--pair-regs", "128")
    assert field(free, "regs") > 128 and field(capped, "regs") <= 128, (free, capped)
    assert field(capped, "local") == 0 and field(capped, "programs/SM") > field(free, "programs/SM")


def test_mxfp4_rows_of_gpt_oss_shapes_copy_16_bytes_at_a_time():
    """gpt-oss' rows are 2880 codes, 360 int32 words: the compiler cannot see that a row starts on
    16 bytes (360 is not a multiple of 16), so without the format's hint every weight load, fill
    copy and store of the 4-bit kernels went a word at a time (cp.async LDGSTS.E, STG.E; one
    token's gate_up stores its float32 act row in 4-byte stores, two a thread)."""
    lines = sass("--formats", "mxfp4", "--kernels", "gate_up_pair", "gate_up_slot", "down_slot", "prefill_gate_up",
                 "--geometry", "gpt-oss", "--fill")
    assert len(lines) == 4
    for line in lines:
        assert not re.search(r"\bLDGSTS\.E \d", line), line
        word_stores = re.search(r"\bSTG\.E (\d+)", line)
        assert not word_stores or int(word_stores[1]) <= 2, line
    pair, slot = lines[:2]
    assert "LDG.E.128" in pair and "STG.E.128" in pair, pair  # the fill's copies from the host
    assert "LDGSTS.E.BYPASS.128" in slot, slot


def test_the_one_row_qkv_with_a_bias_and_a_masked_tail_compiles_for_sm90_with_16_byte_loads():
    """worker/models/linear.py at gpt-oss's K = 2880: three steps of 1024, the last masked, the
    norm and a bias inside; its weights still load 16 bytes at a time and nothing spills."""
    (line,) = sass("--formats", "bf16", "--kernels", "gemv_qkv", "--geometry", "gpt-oss")
    assert field(line, "local") == 0 and "LDG.E.128" in line, line
    assert not re.search(r"\bLDG\.E(\.64)? \d", line), line  # no 4- or 8-byte loads of the weights


@pytest.mark.parametrize("kernel", ["gate_up_pair", "down_token"])
def test_fp8s_one_token_kernels_issue_more_instructions_a_weight_byte_than_bf16s(kernel):
    """The warp-instr/KB column (static: the reductions are unrolled): an fp8 weight is converted
    twice (e4m3 pairs to f16, f16 to f32) and scaled where a bf16 one is shifted, so fp8 issues more
    per KB of weights (docs/architecture.md has the counts)."""
    (fp8,) = sass("--formats", "fp8", "--kernels", kernel)
    (bf16,) = sass("--formats", "bf16", "--kernels", kernel)
    assert field(fp8, "warp-instr/KB") > 1.5 * field(bf16, "warp-instr/KB"), (fp8, bf16)


def test_the_4bit_down_loads_one_tokens_weighted_act_rows_16_bytes_at_a_time():
    """The 4-bit per-token down (WEIGHTED) reads float32 act rows against weights decoded into
    k-ordered registers (``e2m1_words``' K_ORDER), so its act loads are 16-byte vectors: weighing
    bf16 rows there took 192 two-byte loads a thread, 2,096 instructions in all for nvfp4 (1,528
    now); in the other order the float32 rows load 4 bytes at a time. The count is of the down without
    its early reads: in the Triton 3.9 CI has, holding every early word across the PDL wait costs
    instructions of its own (1,856 uncapped, 2,272 at nvfp4's served cap of 64 registers; 1,528 and
    1,584 in Triton 3.6)."""
    for tiles in ((), ("--tiles", "down_early=0", "down_regs=0")):
        lines = sass("--formats", "nvfp4", "mxfp4", "--kernels", "down_token", *tiles)
        assert len(lines) == 2, lines
        for line in lines:
            loads = {op: int(n) for op, n in re.findall(r"\b(LDG\.E[.A-Z0-9]*) (\d+)", line)}
            assert "LDG.E.U16" not in loads and loads["LDG.E.128"] >= loads["LDG.E"], line
            if line.startswith("nvfp4"):  # mxfp4 at its own tiles: one long step of 1,024 weights, 8 warps
                assert loads["LDG.E.128"] >= 48 and (not tiles or field(line, "instructions") < 1700), line


def test_the_fp8_down_reads_one_tokens_weighted_act_rows_as_they_are():
    """One token's gate_up stores its act rows weighted, in float32, zeros where unrouted; the down
    (WEIGHTED) neither masks (FSEL) nor weighs them: at most one FMUL (the block scale) a FFMA, where
    weighing them there took two and a FSEL each (1,088 instructions a thread, then 736; 800 compiled with
    PDL, as served, its early reads held across the wait)."""
    (line,) = sass("--formats", "fp8", "--kernels", "down_token", "--ops", "64")
    ops = {op: int(n) for op, n in (item.split() for item in line.split("ops: ")[1].split(", "))}
    assert "FSEL" not in ops and ops["FMUL"] <= ops["FFMA"] and field(line, "instructions") < 900, line


def test_against_a_sweep_puts_each_timed_tile_beside_its_compiled_counts(tmp_path):
    """``--against``: the tiles a ``bench_grouped_gemm.py --fp8-decode-sweep --json`` file timed, each
    compiled, its time and counts on one line, per part the correlations; rows whose tiles this tree
    no longer has (a fifth field, the removed tensor-core tiles) are left out."""
    sweep = [{"variant": "gate_up", "tokens": 1, "config": [16, 128, 8, 0], "time_us": 25.8},
             {"variant": "gate_up", "tokens": 1, "config": [32, 256, 4, 0], "time_us": 27.9},
             {"variant": "gate_up", "tokens": 1, "config": [8, 128, 8, 0], "time_us": 27.1},
             {"variant": "gate_up", "tokens": 1, "config": [16, 128, 8, 0, "dot"], "time_us": 95.1},
             {"variant": "down", "tokens": 1, "config": [8, 256, 16], "time_us": 25.7},
             {"variant": "down", "tokens": 1, "config": [16, 256, 8], "time_us": 31.6}]
    path = tmp_path / "sweep.json"
    path.write_text(json.dumps({"geometry": {}, "rows": [], "sweep": sweep}))
    out = kernel_sass("--against", str(path), "--unweighted")
    lines = out.splitlines()
    timed = [line.split() for line in lines if line.startswith("  ") and "[" in line]
    assert [float(t[0]) for t in timed] == [25.8, 27.1, 27.9, 25.7, 31.6], out  # fastest first, per part
    down = {float(t[0]): float(t[1]) for t in timed[3:]}
    assert down[25.7] > 300 and down[31.6] < 200, out  # the default down issues the most a KB
    assert sum("r(us, warp-instr/KB)" in line for line in lines) == 1, out  # gate_up only: 3 rows


def test_decode_attention_reads_a_float8_pool_as_words_through_ldmatrix():
    """Read as bytes, a float8 tile reaches the MMAs by byte-wide shared-memory loads; read as words
    (``triton_decode.FP8_WORDS``) it takes ldmatrix, as a bf16 pool does, and fewer instructions a
    key than the byte reading."""
    rows = {line[:10].strip(): line for line in kernel_sass("--arch", "90", script="scripts/attention_regs.py")
            .splitlines() if "loop step" in line}
    assert set(rows) == {"bf16 pool", "fp8 bytes", "fp8 words", "fp8 casts"}, rows
    assert field(rows["fp8 bytes"], "LDS.U8") > 0 and field(rows["fp8 words"], "LDS.U8") == 0, rows
    # widened by one cvt a word, not Triton's casts (which GPUs before sm89 take)
    assert field(rows["fp8 words"], "instructions") < field(rows["fp8 casts"], "instructions"), rows
    assert field(rows["fp8 words"], "ldmatrix") > 0 and field(rows["bf16 pool"], "ldmatrix") > 0, rows
    keys = triton_decode.FP8_BLOCK_N / triton_decode.BLOCK_N  # the word reading's step covers more keys
    assert field(rows["fp8 words"], "instructions") < keys * field(rows["fp8 bytes"], "instructions"), rows



def test_the_4bit_prefill_tiles_of_a_2k_batch_run_warpgroup_mmas():
    """``--prefill-tokens`` picks the tiles a batch of that size takes: 2,048 tokens' (128-row
    blocks, one warpgroup) compile to Hopper's warpgroup MMAs, 16 tokens' (16-row blocks) to
    mma.sync, which is what the prefill GEMM's figures in docs/architecture.md read."""
    out = kernel_sass("--formats", "nvfp4", "--kernels", "prefill_gate_up", "--prefill-tokens", "2048", "--ops", "60")
    small = kernel_sass("--formats", "nvfp4", "--kernels", "prefill_gate_up", "--ops", "60")
    assert re.search(r"HGMMA \d+", out) and not re.search(r"\bHMMA \d+", out), out
    assert re.search(r"\bHMMA \d+", small) and not re.search(r"HGMMA \d+", small), small


def test_bf16_pairs_cut_the_4bit_prefill_loops_instructions(monkeypatch):
    """``SLUICE_W4_BF16_PAIRS=1``: nvfp4 tiles for a bf16 dot decoded as bf16 pairs, one packed
    multiply (HMUL2) a pair where the fp32 path widens (HADD2), scales (FMUL) and packs (F2FP) each
    weight: the K loop's instructions a step fall by a fifth or more (500 -> 390 for the gate_up at
    2,048 tokens, Triton 3.6)."""
    loops = {}
    for pairs in ("0", "1"):
        monkeypatch.setenv("SLUICE_W4_BF16_PAIRS", pairs)
        out = kernel_sass("--formats", "nvfp4", "--kernels", "prefill_gate_up", "prefill_down", "--prefill-tokens",
                          "2048", "--ops", "40", "--loop")
        loops[pairs] = [line for line in out.splitlines() if "its loop" in line]
        assert len(loops[pairs]) == 2, out  # a loop found in each kernel
    for off, on in zip(loops["0"], loops["1"], strict=True):
        ops_off, ops_on = (dict(re.findall(r"([A-Z][A-Z0-9]+) (\d+)", line.split("ops: ")[1])) for line in (off, on))
        assert int(ops_on.get("HMUL2", 0)) >= 32 and "HMUL2" not in ops_off, (off, on)
        assert int(ops_on.get("HADD2", 0)) * 8 <= int(ops_off["HADD2"]), (off, on)  # left: the group scales' widening
        assert field(on, "instructions") < 0.85 * field(off, "instructions"), (off, on)
