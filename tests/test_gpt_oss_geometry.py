"""The gpt-oss geometries (``gpt-oss-120b-geometry``, ``gpt-oss-20b-geometry`` and the toy
``tiny-gpt-oss-geometry``): their shapes and bytes, the dummy-weights runner with experts behind a
cache (biases follow the expert id, not the slot) equal to resident, and bench_prefill end to end
on the toy one."""
from __future__ import annotations

import json

import torch

from moe_offload.formats import MXFP4, ExpertFormat
from moe_offload.offloaded import OffloadedExperts
from scheduler.messages.to_scheduler import SamplingParams
from tests.test_hybrid_geometry import run_script
from worker.batch import SequenceChunk
from worker.config import ModelConfig
from worker.expert_placement import expert_slot_bytes
from worker.models.family_config import FULL_ATTENTION, SLIDING_ATTENTION
from worker.runner import ModelRunner, RunnerConfig
from worker.runner_config import ExpertOptions

TINY = "tiny-gpt-oss-geometry"
GREEDY = SamplingParams()


def test_gpt_oss_geometries_have_the_releases_shapes():
    big, small = ModelConfig.from_dir("gpt-oss-120b-geometry"), ModelConfig.from_dir("gpt-oss-20b-geometry")
    assert (big.family, big.num_layers, big.num_experts, small.num_layers, small.num_experts) == (
        "gpt_oss", 36, 128, 24, 32)
    assert big.layer_types[:2] == (SLIDING_ATTENTION, FULL_ATTENTION) and big.window(0) == 128 and big.window(1) == 0
    assert (big.hidden_size, big.num_heads, big.num_kv_heads, big.head_dim) == (2880, 64, 8, 64)
    assert (big.expert_intermediate_size, big.top_k, big.expert_activation) == (2880, 4, "gpt_oss")
    assert big.yarn.factor == 32 and big.yarn.original_max_positions == 4096 and not big.yarn.truncate
    assert big.num_kv_layers == 36  # every layer keeps KV pages (sliding layers too, for now)
    assert expert_slot_bytes(big, ExpertFormat(torch.bfloat16)) == 3 * 2880 * 2880 * 2  # 49.8 MB
    # MXFP4: two weights a byte and an e8m0 scale per 32 (13.2 MB; the memory plan's unit)
    assert expert_slot_bytes(big, MXFP4) == 3 * 2880 * 2880 // 2 + 3 * 2880 * 2880 // 32


def tiny_runner(**experts) -> ModelRunner:
    return ModelRunner(RunnerConfig(TINY, device="cpu", dtype="float32", page_size=4, kv_tokens=256,
                                    experts=ExpertOptions(dummy_weights=True, **experts)))


def prefill_then_decode(runner: ModelRunner, prompt: list[int], steps: int, chunk: int) -> list[torch.Tensor]:
    pool = runner.kv_pool
    pages = pool.allocate(pool.pages_for(len(prompt) + steps))
    ids, logits = list(prompt), []
    for start in range(0, len(prompt), chunk):
        out = runner.forward([SequenceChunk(ids[start:start + chunk], start, pages)], [GREEDY], [0])
    for step in range(steps + 1):
        logits.append(out.logits[0])
        ids.append(int(out.next_tokens[0]))
        if step < steps:
            out = runner.forward([SequenceChunk(ids[-1:], len(ids) - 1, pages)], [GREEDY], [step + 1])
    pool.free(pages)
    return logits


def test_dummy_runner_offloaded_equals_resident():
    """Experts behind a cache of 75 % (slots are not expert ids: the biases must follow the id)
    and the prefill pipeline (a 40-token chunk routes 160 pairs >= 4E), against resident experts."""
    offloaded, resident = tiny_runner(cache_fraction=0.75), tiny_runner()
    assert isinstance(offloaded.experts, OffloadedExperts)
    assert offloaded.weights.layers[0].expert_bias.w13.abs().sum() > 0
    prompt = list(range(5, 45))
    want = prefill_then_decode(resident, prompt, 6, chunk=len(prompt))
    for got in (prefill_then_decode(offloaded, prompt, 6, chunk=len(prompt)),
                prefill_then_decode(resident, prompt, 6, chunk=7)):
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_bench_prefill_runs_on_the_tiny_gpt_oss_geometry(tmp_path):
    out = tmp_path / "prefill.json"
    run_script(["scripts/bench_prefill.py", "--device", "cpu", "--model", TINY, "--fractions", "0.75",
                "--chunks", "24", "--prefix", "20", "--invalidate", "fixed", "--mirror", "--warmup", "0",
                "--json", str(out)])
    rows = json.loads(out.read_text())["chunks"]
    assert [(r["chunk"], r["prefix"], r["invalidate"]) for r in rows] == [
        (24, 0, "fixed"), (24, 0, "mirror"), (24, 20, "fixed"), (24, 20, "mirror")]
    assert all(r["pcie_gb"] > 0 for r in rows)
