"""Kernels per layer of a decode step, counted on the CPU (tests/launch_count.py): the step of the
CUDA graphs (worker.cuda_graph) run eagerly with every Triton kernel interpreted, on a tiny Qwen3
model in bf16. A decode step is bound by its kernel count (issue 12), so the count is pinned."""
from __future__ import annotations

import dataclasses
import os
from collections import Counter

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from moe_offload.kernels.grouped_gemm_decode import DECODE_MAX_PAIRS, DECODE_MAX_TOKENS  # noqa: E402
from tests.launch_count import count_launches, launches_kernel  # noqa: E402
from tests.tiny_models import write_tiny  # noqa: E402
from worker.attention import create_backend  # noqa: E402
from worker.batch import SequenceChunk  # noqa: E402
from worker.cuda_graph import DecodeGraphs  # noqa: E402
from worker.runner import ModelRunner, RunnerConfig  # noqa: E402
from scheduler.messages.to_scheduler import SamplingParams  # noqa: E402

interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")

# one decoder layer of a decode step: 9 launches at one sequence (the input norm inside the qkv
# projection, q/k norm, RoPE and the KV-pool write inside the attention, one program per expert pair
# in gate_up), 10 up to DECODE_MAX_TOKENS sequences, 11 up to DECODE_MAX_PAIRS (token, expert)
# pairs, 12 above (the align path's four expert launches); before the fusions of issue 12, 15 at
# every batch size, and one more before RoPE joined the attention (qk_rope_kernel)
ATTENTION = {
    "dense": 2,  # qkv, o
    "triton.decode_rope_partial_kernel": 1,  # q/k norm, RoPE, the KV-pool write and the splits' attention
    "triton.decode_reduce_kernel": 1,
    "triton.add_rms_norm_kernel": 2,  # after attention and after the MoE
}
ROUTER = {"dense": 1, "triton.topk_softmax_kernel": 1}
PER_TOKEN_DOWN = {"triton._decode_gate_up_kernel": 1, "triton._decode_down_kernel": 1}
PER_SLOT_DOWN = {"triton._decode_gate_up_kernel": 1, "triton._decode_slot_down_kernel": 1, "triton._sum_k_kernel": 1}
# the rest of a step: the inputs' unpacking, embedding, final norm, LM head and sampling (62 before
# the sampler's hash noise became one launch and the last residual add joined the final norm, 30
# before sampling became one kernel: no sort, cumsum or elementwise top-k/top-p ops; 11 before the
# grammar mask joined the graphs' step: one launch whose programs return at once for unconstrained rows)
STEP = 12



def decode_graphs(model_dir, batch: int) -> DecodeGraphs:
    """Graphs (run eagerly) of a bf16 CPU runner, after one decode step of ``batch`` sequences."""
    runner = ModelRunner(RunnerConfig(str(model_dir), device="cpu", dtype="bfloat16", page_size=4, kv_tokens=256))
    cfg = runner.model_config
    graphs = DecodeGraphs(runner.model, create_backend("triton", runner.kv_pool, cfg.head_dim ** -0.5),
                          runner.kv_pool, 16, 8, use_graphs=False)  # a short page table: fewer interpreted programs
    chunks = [SequenceChunk([3 + b], 5, runner.kv_pool.allocate(2)) for b in range(batch)]
    graphs.run(chunks, [SamplingParams()] * batch, [1] * batch)
    return graphs


def step_launches(graphs: DecodeGraphs, bucket: int, layers: int) -> Counter:
    """Launches of one graph step of ``bucket`` rows through the model's first ``layers`` layers."""
    model = graphs.model
    full = model.weights
    model.weights = dataclasses.replace(full, layers=full.layers[:layers])
    try:
        with count_launches() as counter:
            graphs._step(graphs.captured[bucket].inputs, bucket)
    finally:
        model.weights = full
    return counter.launches


@interpreted
@pytest.mark.parametrize("batch", [1, 8])
def test_decode_step_kernels_per_layer(tmp_path, monkeypatch, batch):
    """The second layer adds the launches of one layer (the first also pays for the embedding,
    the final norm, the LM head and sampling)."""
    write_tiny(tmp_path, "qwen3_moe", layers=2, experts=16, top_k=4)
    monkeypatch.setenv("SLUICE_KERNELS", "triton")
    graphs = decode_graphs(tmp_path, batch)
    one_layer = step_launches(graphs, batch, 1)
    per_layer = step_launches(graphs, batch, 2) - one_layer
    assert batch * 4 <= DECODE_MAX_PAIRS
    experts = PER_TOKEN_DOWN if batch <= DECODE_MAX_TOKENS else PER_SLOT_DOWN
    if batch == 1:  # one token's gate_up: a program per pair
        experts = {**experts, "triton._decode_gate_up_pair_kernel": 1}
        del experts["triton._decode_gate_up_kernel"]
    expected = Counter(ATTENTION) + Counter(ROUTER) + Counter(experts)
    if batch == 1:  # worker.models.linear: one row's projections, the input norm inside qkv's
        expected["triton.gemv_kernel"] = expected.pop("dense")
        expected["triton.add_rms_norm_kernel"] -= 1
    else:
        expected["aten.mm"] = expected.pop("dense")
    assert per_layer == expected
    assert sum((one_layer - per_layer).values()) == STEP

def test_views_and_allocations_launch_nothing():
    aten = torch.ops.aten
    assert not launches_kernel(aten.view.default) and not launches_kernel(aten.empty.memory_format)
    assert not launches_kernel(aten.split.Tensor) and not launches_kernel(aten.t.default)
    assert launches_kernel(aten.index_copy_.default) and launches_kernel(aten.mm.default)
    assert launches_kernel(aten.copy_.default) and launches_kernel(aten.clone.default)


@interpreted
def test_gpt_oss_biases_add_no_launch_at_one_row(tmp_path, monkeypatch):
    """gpt-oss's q/k/v, o and router biases are added inside their projections' launches (one
    ``gemv_kernel`` each), not by elementwise launches after them: a sliding and a full layer."""
    from tests.tiny_gpt_oss import FULL, SLIDING, write_tiny_gpt_oss

    write_tiny_gpt_oss(tmp_path, layer_types=(SLIDING, SLIDING, FULL), dtype=torch.bfloat16)
    monkeypatch.setenv("SLUICE_KERNELS", "triton")
    graphs = decode_graphs(tmp_path, 1)
    first = step_launches(graphs, 1, 1)
    for layers in (2, 3):  # the second layer is a sliding one, the third a full one
        per_layer = step_launches(graphs, 1, layers) - step_launches(graphs, 1, layers - 1)
        assert per_layer["triton.gemv_kernel"] == 3, per_layer  # qkv (its norm inside), o, router
        assert not [name for name in per_layer if name.startswith("aten.add")], per_layer
    assert first["triton.gemv_kernel"] == 3
