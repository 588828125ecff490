"""FP8 checkpoints of the hybrid families (Qwen3.5-MoE, Qwen3-Next), as Qwen's block-FP8 releases
write them: every Linear in e4m3 with its scale, but for the modules the release leaves in bf16
(``modules_to_not_convert``: the LM head, the routers and shared-expert gates, the vision tower,
Qwen3.5's small in_proj_a/b). Sluice on the fp8 checkpoint vs transformers on its dequantized twin
(CPU, fp32); the dense weights, Qwen3-Next's grouped in_proj_qkvz/in_proj_ba included, equal
Sluice's load of that twin bit for bit (so each block scale was applied to the rows it was computed
on, before the regrouping); ``--expert-dtype fp8`` quantizes a bf16 hybrid checkpoint's experts."""
from __future__ import annotations

import json
import shutil
from functools import partial
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
from safetensors.torch import load_file, save_file

from moe_offload.expert_names import detect_names
from moe_offload.fp8 import BLOCK_128, FP8_DTYPE, dequantize, dequantize_w13, quantize_w13
from moe_offload.formats import ExpertFormat
from moe_offload.offloaded import OffloadedExperts
from moe_offload.safetensors_file import index_files
from scheduler.generate import generate
from scheduler.messages.to_scheduler import SamplingParams
from tests.parity_helpers import check_batch_decode, rel_err
from tests.parity_helpers import cpu_runner as parity_cpu_runner
from tests.tiny_fp8 import LAYOUTS, assert_experts_stay_fp8, quantize_stored
from tests.tiny_hybrid import write_tiny_hybrid
from worker.batch import SequenceChunk
from worker.config import ModelConfig
from worker.models.weights import ModelWeights
from worker.expert_format import checkpoint_expert_format
from worker.runner import ModelRunner

GREEDY = SamplingParams()
# hidden 160 and expert FFN 144 are not multiples of the 128 block (ragged edges, two row blocks per
# w13 half); q_proj (q and gate rows per head), in_proj_qkv and Qwen3-Next's in_proj_qkvz span two or
# three row blocks, and the Next's key-head groups (192 rows) straddle their borders
SHAPE = dict(layer_types=("linear_attention", "full_attention", "linear_attention"), hidden=160, heads=4, kv_heads=2,
             head_dim=32, linear_k_heads=2, linear_v_heads=4, linear_k_dim=32, linear_v_dim=32, experts=4, top_k=2,
             inter=144, shared_inter=80, vocab=128)
# what Qwen's fp8 releases of these families leave unquantized (names as modules_to_not_convert has them)
NOT_CONVERTED = ["lm_head", "model.visual", "mlp.gate", "mlp.shared_expert_gate", "linear_attn.in_proj_a",
                 "linear_attn.in_proj_b"]
CASES = [("qwen3_5_moe", "hf-block"), ("qwen3_next", "hf-block"), ("qwen3_next", "ct-channel"),
         ("qwen3_5_moe_causal", "ct-block")]


class TinyHybridFP8(NamedTuple):
    src: Path  # the float32 checkpoint transformers wrote
    fp8_dir: Path  # quantized
    float_dir: Path  # the same model dequantized, float32, no quantization_config
    hf: torch.nn.Module  # transformers on float_dir


def is_quantized(name: str, tensor: torch.Tensor) -> bool:
    """The Linears a release converts: matrices, not embeddings, and none of ``NOT_CONVERTED``."""
    if tensor.dim() != 2 or name.endswith("embed_tokens.weight"):
        return False
    module = name.removesuffix(".weight")
    return not any(module == m or module.endswith("." + m) or module.startswith(m + ".") for m in NOT_CONVERTED)


def quantization_config(layout: str) -> dict:
    qc = json.loads(json.dumps(LAYOUTS[layout].quantization_config))
    if layout == "hf-block":
        qc["modules_to_not_convert"] = NOT_CONVERTED
    return qc


def write_hybrid_fp8(root: Path, family: str, layout: str) -> TinyHybridFP8:
    src, fp8_dir, float_dir = root / "src", root / f"fp8-{layout}", root / "float"
    hf = write_tiny_hybrid(src, family, seed=5, **SHAPE)
    spec = LAYOUTS[layout]
    quantized, floats = {}, {}
    for name, w in load_file(src / "model.safetensors").items():
        if is_quantized(name, w):
            quantized[name], quantized[name + spec.scale_suffix], floats[name] = quantize_stored(w, spec)
        else:
            quantized[name] = floats[name] = w
    grouped = ("in_proj_qkvz", "in_proj_ba") if family == "qwen3_next" else ("in_proj_qkv", "self_attn.q_proj")
    assert all(any(f"{g}.weight{spec.scale_suffix}" in n for n in quantized) for g in grouped)
    config = json.loads((src / "config.json").read_text())
    for path, tensors, cfg in ((fp8_dir, quantized, {**config, "quantization_config": quantization_config(layout)}),
                               (float_dir, floats, config)):
        path.mkdir()
        tensors = {k: v.contiguous() for k, v in tensors.items()}
        save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
        (path / "config.json").write_text(json.dumps(cfg))
        shutil.copy(src / "generation_config.json", path)
    reference = type(hf).from_pretrained(float_dir, dtype=torch.float32).eval()
    return TinyHybridFP8(src, fp8_dir, float_dir, reference)


cpu_runner = partial(parity_cpu_runner, state_slots=4)


@pytest.fixture(scope="module", params=CASES, ids=lambda c: f"{c[0]}-{c[1]}")
def tiny(request, tmp_path_factory):
    family, layout = request.param
    return layout, write_hybrid_fp8(tmp_path_factory.mktemp("hybrid-fp8"), family, layout)


def test_hybrid_fp8_checkpoint_matches_transformers_on_dequantized_weights(tiny):
    layout, model = tiny
    runner = cpu_runner(model.fp8_dir)
    assert_experts_stay_fp8(runner, model.fp8_dir, layout)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 120, (n,), generator=gen).tolist() for n in (1, 9, 23)]  # 120+: image ids
    slots = [runner.state_pool.running_slot(b) for b in range(len(prompts))]
    check_batch_decode(runner, model.hf, prompts, steps=4, state_slots=slots, use_cache=False)


def tensors_of(weights) -> list[torch.Tensor]:
    """Every tensor of a weights dataclass, in field order (nested dataclasses flattened)."""
    out = []
    for value in vars(weights).values():
        if isinstance(value, torch.Tensor):
            out.append(value)
        elif value is not None:
            out += tensors_of(value)
    return out


def test_dense_weights_are_the_dequantized_ones_in_their_own_row_order(tiny):
    """The fp8 load equals the load of the dequantized twin bit for bit, reordered weights (gated
    q_proj, Qwen3-Next's grouped in_proj_qkvz and in_proj_ba) included: each scale was applied to
    the rows it was computed on, before the rows moved."""
    _, model = tiny
    cpu = torch.device("cpu")

    def load(path: Path, with_experts: bool = False) -> ModelWeights:
        return ModelWeights.load(path, ModelConfig.from_dir(path), torch.float32, cpu, with_experts)

    fp8, ref = load(model.fp8_dir), load(model.float_dir)
    mine = [t for lw in fp8.layers for t in tensors_of(lw)]
    theirs = [t for lw in ref.layers for t in tensors_of(lw)]
    assert len(mine) == len(theirs) > 0
    for a, b in zip(mine, theirs):
        assert torch.equal(a, b)
    assert not torch.equal(fp8.layers[0].linear.in_proj, load(model.src).layers[0].linear.in_proj)  # rounded
    floats, banks = load(model.float_dir, with_experts=True), load(model.fp8_dir, with_experts=True).experts
    assert torch.equal(dequantize_w13(banks.w13, banks.w13_scale, banks.scale_block), floats.experts.w13)


def test_offloaded_hybrid_fp8_generation_equals_resident(tiny):
    _, model = tiny
    resident, offloaded = cpu_runner(model.fp8_dir), cpu_runner(model.fp8_dir, cache_fraction=0.5)
    assert isinstance(offloaded.experts, OffloadedExperts) and offloaded.experts.cache.w13.dtype == FP8_DTYPE
    for prompt in ([5, 9, 11, 3], list(range(1, 20))):
        want = generate(resident, prompt, GREEDY, 8).token_ids
        assert generate(offloaded, prompt, GREEDY, 8).token_ids == want


# ==== --expert-dtype fp8 on a bf16 checkpoint ====


@pytest.fixture(scope="module", params=["qwen3_5_moe", "qwen3_next"])
def bf16_hybrid(request, tmp_path_factory):
    """A bf16 checkpoint as the releases' masters are: Qwen3.5's experts fused (``gate_up_proj``)."""
    root = tmp_path_factory.mktemp("hybrid-bf16")
    src, out = root / "src", root / "bf16"
    write_tiny_hybrid(src, request.param, seed=6, fused_experts=request.param == "qwen3_5_moe", **SHAPE)
    out.mkdir()
    tensors = {k: v.to(torch.bfloat16) for k, v in load_file(src / "model.safetensors").items()}
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "torch_dtype": "bfloat16"}))
    return out


def test_expert_dtype_fp8_quantizes_a_bf16_hybrid_checkpoints_experts(bf16_hybrid):
    path = bf16_hybrid
    assert checkpoint_expert_format(path) == ExpertFormat(torch.bfloat16)
    resident = cpu_runner(path, expert_dtype="fp8")
    offloaded = cpu_runner(path, expert_dtype="fp8", cache_fraction=0.5)  # quantized as the store fills
    assert resident.expert_format == ExpertFormat(FP8_DTYPE, BLOCK_128) == offloaded.expert_format
    assert offloaded.experts.cache.w13.dtype == FP8_DTYPE
    # layer 1, expert 2 of the resident banks: the bf16 weights quantized 128 x 128, each half its own grid
    index = index_files([path / "model.safetensors"])
    names = detect_names(index.keys(), 1)
    if names.gate_up is not None:
        w13 = index[names.gate_up.format(layer=1)].tensor(names.gate_up.format(layer=1))[2]
    else:
        w13 = torch.cat([index[t].tensor(t) for t in (names.gate.format(layer=1, expert=2),
                                                      names.up.format(layer=1, expert=2))])
    q, scale = quantize_w13(w13.float(), BLOCK_128)
    banks = resident.weights.experts
    assert torch.equal(banks.w13[1, 2].view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(banks.w13_scale[1, 2], scale)
    prompt = list(range(3, 40))
    want = generate(resident, prompt, GREEDY, 6).token_ids
    assert generate(offloaded, prompt, GREEDY, 6).token_ids == want
    # the fp8 run is the float model with the experts rounded to fp8: a float runner given the
    # dequantized banks computes the same logits
    float_run = cpu_runner(path)
    floats = float_run.weights.experts
    rounded = dequantize_w13(banks.w13, banks.w13_scale, BLOCK_128)
    assert rel_err(rounded, floats.w13) > 0  # fp8 really rounded them
    floats.w13.copy_(rounded)
    floats.w2.copy_(dequantize(banks.w2, banks.w2_scale, BLOCK_128))

    def logits(runner: ModelRunner) -> torch.Tensor:
        pages = runner.kv_pool.allocate(runner.kv_pool.pages_for(len(prompt)))
        return runner.forward([SequenceChunk(prompt, 0, pages, state_slot=1)], [GREEDY], [0]).logits

    assert rel_err(logits(resident), logits(float_run)) < 1e-5
