"""The hybrid geometries (``qwen3.5-35b-a3b-geometry`` and its toy twin ``tiny-hybrid-geometry``):
their shapes and bytes, the dummy-weights runner with a state slot, and the benchmarks run end to
end on CPU on the toy one (bench_prefill, bench_decode, agent_ab)."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moe_offload.fp8 import BLOCK_128, FP8_DTYPE
from moe_offload.formats import ExpertFormat
from moe_offload.offloaded import OffloadedExperts
from scheduler.messages.to_scheduler import SamplingParams
from worker.batch import SequenceChunk
from worker.config import ModelConfig
from worker.models.family_config import FULL_ATTENTION, LINEAR_ATTENTION
from worker.expert_placement import expert_slot_bytes
from worker.geometry_tokenizer import tokenizer_dir
from worker.runner import ModelRunner, RunnerConfig
from worker.runner_config import ExpertOptions

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))  # the benchmarks import report_table beside them
import bench_decode  # noqa: E402
import bench_prefill  # noqa: E402

TINY = "tiny-hybrid-geometry"
GREEDY = SamplingParams()


def test_qwen3_5_geometry_has_the_releases_shapes():
    cfg = ModelConfig.from_dir("qwen3.5-35b-a3b-geometry")
    assert (cfg.family, cfg.vocab_size, cfg.hidden_size, cfg.num_layers) == ("qwen3_5_moe", 248320, 2048, 40)
    assert cfg.layer_types[:4] == (LINEAR_ATTENTION,) * 3 + (FULL_ATTENTION,)
    assert cfg.full_layers == list(range(3, 40, 4)) and cfg.num_kv_layers == 10 and len(cfg.linear_layers) == 30
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rotary_dim) == (16, 2, 256, 64)
    assert cfg.attn_output_gate and cfg.norm_offset and cfg.rope_theta == 1e7
    la = cfg.linear
    assert (la.num_k_heads, la.num_v_heads, la.head_k_dim, la.head_v_dim, la.conv_kernel) == (16, 32, 128, 128, 4)
    assert (cfg.num_experts, cfg.top_k, cfg.expert_intermediate_size, cfg.shared_expert_size) == (256, 8, 512, 512)
    assert cfg.max_context == 262144 and cfg.eos_token_ids == (248046,)
    # 3 x 2048 x 512 x 2 B per expert in bf16; fp8 halves it and adds 2 x (4 x 16) + 16 x 4 scales of 4 B
    assert expert_slot_bytes(cfg, ExpertFormat(torch.bfloat16)) == 3 * 2048 * 512 * 2 == 6_291_456
    assert expert_slot_bytes(cfg, ExpertFormat(FP8_DTYPE, BLOCK_128)) == 3 * 2048 * 512 + (2 * 4 * 16 + 16 * 4) * 4


def test_tiny_hybrid_geometry_is_the_same_structure():
    cfg = ModelConfig.from_dir(TINY)
    assert cfg.family == "qwen3_5_moe" and cfg.is_hybrid and cfg.full_layers == [3]
    assert cfg.shared_expert_size and cfg.rotary_dim == cfg.head_dim // 4


@pytest.mark.parametrize("model, kind", [(TINY, "bytes"), ("qwen3.5-35b-a3b-geometry", None)])
def test_hybrid_geometries_come_with_a_tokenizer(tmp_path, monkeypatch, model, kind):
    monkeypatch.setenv("SLUICE_CACHE", str(tmp_path))
    path = tokenizer_dir(model)
    assert (path / "tokenizer.json").is_file()
    if kind:  # 248320 ids: the default model's where its package is installed, else bytes
        assert path.name == kind


def tiny_runner(**experts) -> ModelRunner:
    return ModelRunner(RunnerConfig(TINY, device="cpu", dtype="float32", page_size=4, kv_tokens=256, state_slots=2,
                                    experts=ExpertOptions(dummy_weights=True, **experts)))


def prefill_then_decode(runner: ModelRunner, prompt: list[int], steps: int, chunk: int) -> list[torch.Tensor]:
    """Logits of the prompt's last token (prefilled ``chunk`` tokens at a time) and of ``steps``
    greedy decode steps, in state slot 1."""
    pool = runner.kv_pool
    pages = pool.allocate(pool.pages_for(len(prompt) + steps))
    ids, logits = list(prompt), []
    for start in range(0, len(prompt), chunk):
        out = runner.forward([SequenceChunk(ids[start:start + chunk], start, pages, state_slot=1)], [GREEDY], [0])
    for step in range(steps + 1):
        logits.append(out.logits[0])
        ids.append(int(out.next_tokens[0]))
        if step < steps:
            out = runner.forward([SequenceChunk(ids[-1:], len(ids) - 1, pages, state_slot=1)], [GREEDY], [step + 1])
    pool.free(pages)
    return logits


def test_dummy_runner_runs_with_a_state_slot_offloaded_as_resident():
    """The dummy-weights path of a hybrid geometry: a state pool, experts behind a cache (the same
    seeded weights as resident), and a prefill in chunks that carries the state as one chunk does."""
    offloaded, resident = tiny_runner(cache_fraction=0.75), tiny_runner()
    assert isinstance(offloaded.experts, OffloadedExperts) and offloaded.state_pool.running == 2
    prompt = list(range(5, 30))
    want = prefill_then_decode(resident, prompt, 4, chunk=len(prompt))
    for got in (prefill_then_decode(offloaded, prompt, 4, chunk=len(prompt)),
                prefill_then_decode(resident, prompt, 4, chunk=7)):
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_decode_bound_counts_the_hybrid_weights_state_and_kv():
    """bench_decode's HBM bound: every dense weight a step reads (linear attention and shared expert
    included), and per sequence the KV of the full-attention layers and the state read and written."""
    runner = tiny_runner()
    cfg, la, H = runner.model_config, runner.model_config.linear, runner.model_config.hidden_size
    shared = (2 * cfg.shared_expert_size + 1) * H + H * cfg.shared_expert_size
    common = 2 * H + cfg.num_experts * H + shared
    linear = la.in_proj_size * H + la.conv_dim * la.conv_kernel + 2 * la.num_v_heads + la.head_v_dim + H * la.value_dim
    full = (2 * cfg.q_size + 2 * cfg.kv_size) * H + H * cfg.q_size + 2 * cfg.head_dim
    by_hand = 4 * (4 * common + 3 * linear + full + cfg.vocab_size * H)  # float32
    assert bench_decode.dense_bytes(runner) == by_hand
    state = 3 * (la.conv_dim * (la.conv_kernel - 1) + la.num_v_heads * la.head_k_dim * la.head_v_dim) * 4
    assert runner.state_pool.slot_bytes == state
    assert bench_decode.sequence_bytes(runner, 100) == 1 * 2 * cfg.kv_size * 100 * 4 + 2 * state


def test_prefill_bench_restores_the_prefix_state_before_each_chunk():
    """bench_prefill times a chunk after the prefix again and again: each run must start from the
    prefix's state (and so give the same logits), not from where the last run left it."""
    runner = tiny_runner(cache_fraction=0.75)
    logits = []
    forward = runner.forward

    def keep(*args, **kwargs):
        out = forward(*args, **kwargs)
        logits.append(out.logits[0].clone())
        return out

    runner.forward = keep
    prompt = list(range(3, 43))
    seq = bench_prefill.Sequence.allocate(runner, len(prompt) + 3)
    assert seq.slot == 1 and seq.snapshot > runner.state_pool.running
    bench_prefill.run_chunk(runner, prompt[:24], 0, seq)
    bench_prefill.run_chunk(runner, prompt[24:], 24, seq)
    seq.save_state(runner)  # ... of the whole prompt: the next runs start from it
    seq.restore_state(runner)
    bench_prefill.run_chunk(runner, [7, 8, 9], 40, seq)
    seq.restore_state(runner)
    bench_prefill.run_chunk(runner, [7, 8, 9], 40, seq)
    torch.testing.assert_close(logits[-1], logits[-2], rtol=0, atol=0)
    bench_prefill.run_chunk(runner, [7, 8, 9], 40, seq)  # not restored: another state
    assert not torch.allclose(logits[-1], logits[-2])


# ==== the benchmarks end to end on CPU ====


def run_script(args: list[str], timeout: float = 600) -> subprocess.CompletedProcess:
    # SLUICE_PY: serve.sh (agent_ab's servers) runs this interpreter instead of setting up a .venv
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "1", "SLUICE_PY": sys.executable}
    proc = subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_bench_prefill_runs_on_the_tiny_hybrid_geometry(tmp_path):
    out = tmp_path / "prefill.json"
    proc = run_script(["scripts/bench_prefill.py", "--device", "cpu", "--model", TINY, "--fractions", "0.75",
                       "--chunks", "24", "--prefix", "20", "--invalidate", "fixed", "--warmup", "0",
                       "--top-kernels", "4", "--json", str(out)])
    rows = json.loads(out.read_text())["chunks"]
    assert all(r["top_kernels"] == [] and r["busy_s"] == 0 for r in rows)  # profiled; the host runs no kernels
    assert [(r["chunk"], r["prefix"], r["invalidate"]) for r in rows] == [(24, 0, "fixed"), (24, 20, "fixed")]
    slot = expert_slot_bytes(ModelConfig.from_dir(TINY), ExpertFormat(torch.float32))
    for r in rows:
        assert r["expert_mb"] == slot / 1e6 and r["pcie_gb"] > 0 and r["bound"] == "pcie"
    assert f"experts of float32 {slot / 1e6:.3g} MB each" in proc.stdout.splitlines()[0]


@pytest.mark.slow
def test_bench_decode_runs_on_the_tiny_hybrid_geometry(tmp_path):
    out = tmp_path / "decode.json"
    run_script(["scripts/bench_decode.py", "--device", "cpu", "--model", TINY, "--fractions", "0.75", "--batch", "2",
                "--prompt-tokens", "8", "40", "--decode-tokens", "4", "--repeats", "3", "--json", str(out)])
    rows = json.loads(out.read_text())
    assert [r["prompt"] for r in rows] == [8, 40]  # a row per prompt length: decode over a longer context
    runner = tiny_runner()
    for row in rows:
        assert row["batch"] == 2 and row["tok_s"] > 0 and 0 < row["hit_rate"] <= 1
        assert row["runs"] == 3 and row["spread"] >= 0
        assert row["dense_bytes"] == bench_decode.dense_bytes(runner)
        assert row["sequence_bytes"] == 2 * bench_decode.sequence_bytes(runner, row["prompt"] + 4 // 2)
        assert row["expert_bytes"] == expert_slot_bytes(runner.model_config, ExpertFormat(torch.float32))


def test_bench_decode_gives_an_offloaded_row_its_ceiling(tmp_path):
    """The offloaded row's ceiling comes through the script (on the CPU there are no kernels: no
    non-expert time, so the ceiling is 1; the resident row gets none)."""
    out = tmp_path / "decode.json"
    run_script(["scripts/bench_decode.py", "--device", "cpu", "--model", TINY, "--fractions", "1.0", "0.75",
                "--batch", "2", "--prompt-tokens", "8", "--decode-tokens", "4", "--routing", "synthetic",
                "--json", str(out)])
    resident, offloaded = json.loads(out.read_text())
    assert resident["fraction"] == 1.0 and resident["non_expert_ms"] == 0 and math.isnan(resident["ceiling"])
    assert offloaded["step_pcie"] > 0 and offloaded["ceiling"] == 1.0
    assert 0 < offloaded["shared_bytes"] < offloaded["dense_bytes"]  # the tiny hybrid has shared experts
    at_peak = (offloaded["dense_bytes"] - offloaded["shared_bytes"] + offloaded["sequence_bytes"]) / \
        bench_decode.HBM_BYTES_PER_S
    assert offloaded["peak_ceiling"] == pytest.approx(offloaded["step_pcie"] / (offloaded["step_pcie"] + at_peak))


@pytest.mark.slow
def test_agent_ab_runs_on_the_tiny_hybrid_geometry(tmp_path):
    """Both builds serve the hybrid geometry (dummy weights, CPU); prompt ids stay inside its 256."""
    out = tmp_path / "ab.json"
    run_script(["scripts/agent_ab.py", "--serve", f"--device cpu --model {TINY} --dummy-weights", "--sessions", "2",
                "--turns", "3", "--context", "40", "--tool-tokens", "12", "--max-tokens", "3", "--id-range", "200",
                "--warmup-turns", "1", "--json", str(out), "--no-plot", "--log-dir", str(tmp_path / "logs")])
    result = json.loads(out.read_text())
    for label in "AB":
        s = result["summary"][label]
        assert s["turns"] == 6 and s["cached_tokens"] > 0  # the prefix cache served the history
