"""gpt-oss's experts in the bf16 grouped GEMM: biases (indexed by expert id, not by slot) and the
clamped SwiGLU, the Triton kernels against the eager twin (interpreted on the CPU, compiled on a
GPU under sync debug mode), and the twin against transformers' own expert module."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from moe_offload.grouped import ExpertBias, bias_args, grouped_swiglu, grouped_swiglu_eager  # noqa: E402
from tests.test_grouped_gemm import interpreted, make_routing, rel_err  # noqa: E402
from worker.models.gpt_oss import deinterleave  # noqa: E402


def gpt_oss_case(num_tokens, top_k, num_experts, dim, inter, dtype=torch.float32, device="cpu", seed=0,
                 case="random"):
    """Banks large enough that the clamps at +-7 bite, biases far from zero, and slots that are a
    permutation of the expert ids (as in an expert cache: a bias must follow the id, not the slot)."""
    gen = torch.Generator().manual_seed(seed)
    w13 = torch.randn(num_experts, 2 * inter, dim, generator=gen) * 0.6
    w2 = torch.randn(num_experts, dim, inter, generator=gen) * 0.2
    bias = ExpertBias(torch.randn(num_experts, 2 * inter, generator=gen) * 2,
                      torch.randn(num_experts, dim, generator=gen))
    hidden = torch.randn(num_tokens, dim, generator=gen)
    weights, ids = make_routing(case, num_tokens, top_k, num_experts, seed=seed)
    slot_of = torch.randperm(num_experts, generator=gen)
    slots = slot_of[ids]
    w13 = w13[torch.argsort(slot_of)]  # slot s holds expert argsort(slot_of)[s]
    w2 = w2[torch.argsort(slot_of)]
    to = dict(device=device)
    return (hidden.to(dtype).to(**to), weights.to(**to), slots.to(**to), w13.to(dtype).to(**to),
            w2.to(dtype).to(**to), ExpertBias(bias.w13.to(dtype).to(**to), bias.w2.to(dtype).to(**to)), ids.to(**to))


def test_twin_matches_transformers_experts():
    """``grouped_swiglu_eager`` with the de-interleaved banks equals ``GptOssExperts`` on the
    checkpoint's layout (gate_up [E, H, 2I] interleaved by column)."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    E, H, I, T, k = 6, 32, 16, 20, 3
    cfg = transformers.GptOssConfig(num_local_experts=E, hidden_size=H, intermediate_size=I, num_experts_per_tok=k)
    experts = GptOssExperts(cfg)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.8)
        hidden = torch.randn(T, H, generator=gen)
        ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])
        weights = torch.softmax(torch.randn(T, k, generator=gen), -1)
        want = experts(hidden, ids, weights)
    w13 = deinterleave(experts.gate_up_proj.detach()).transpose(1, 2)  # [E, 2I, H], gate rows then up rows
    w2 = experts.down_proj.detach().transpose(1, 2)
    bias = ExpertBias(deinterleave(experts.gate_up_proj_bias.detach()), experts.down_proj_bias.detach())
    got = grouped_swiglu_eager(hidden, weights, ids, w13, w2, activation="gpt_oss", **bias_args(bias, ids))
    assert rel_err(got, want) < 1e-5


def check(shape, case, dtype, device, tol):
    hidden, weights, slots, w13, w2, bias, ids = gpt_oss_case(*shape, dtype=dtype, device=device, case=case)
    want = grouped_swiglu_eager(hidden.float(), weights, slots, w13.float(), w2.float(), activation="gpt_oss",
                                **bias_args(ExpertBias(bias.w13.float(), bias.w2.float()), ids))
    if device == "cuda":
        torch.cuda.set_sync_debug_mode("error")
    try:
        got = grouped_swiglu(hidden, weights, slots, w13, w2, activation="gpt_oss", backend="triton",
                             **bias_args(bias, ids))
    finally:
        if device == "cuda":
            torch.cuda.set_sync_debug_mode(0)
    assert rel_err(got, want) < tol, (shape, case)


SHAPES = [(5, 4, 8, 32, 16), (40, 4, 6, 64, 48), (1, 4, 8, 32, 16), (3, 2, 4, 48, 32)]


@interpreted
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("case", ["random", "duplicates", "zero_weights"])
def test_kernels_match_twin_interpreted(shape, case):
    """Decode batches (one token; a few: per-token and per-slot downs) and a prefill-sized one."""
    check(shape, case, torch.float32, "cpu", 1e-5)


def test_the_clamps_bite():
    hidden, weights, slots, w13, w2, bias, ids = gpt_oss_case(*SHAPES[1])
    inter = w2.shape[2]
    gate_up = torch.einsum("th,sih->tsi", hidden, w13)
    assert (gate_up[..., :inter] > 7).any() and (gate_up[..., inter:] < -7).any()


def test_silu_without_biases_is_unchanged():
    hidden, weights, slots, w13, w2, bias, ids = gpt_oss_case(*SHAPES[0])
    plain = grouped_swiglu_eager(hidden, weights, slots, w13, w2)
    assert torch.equal(grouped_swiglu(hidden, weights, slots, w13, w2, activation="silu"), plain)


@pytest.mark.cuda
@pytest.mark.parametrize("shape", SHAPES + [(2048, 4, 8, 2880, 2880), (8, 4, 8, 2880, 2880)])
def test_kernels_match_twin_on_gpu(shape):
    """bf16 on the H200, gpt-oss-120b's expert shapes (hidden and expert width 2880) among them,
    under sync debug mode."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    check(shape, "random", torch.bfloat16, "cuda", 2e-2)
