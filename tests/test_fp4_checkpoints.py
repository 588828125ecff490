"""4-bit checkpoints (ModelOpt NVFP4, compressed-tensors nvfp4 and mxfp4, gpt-oss's MXFP4 blocks)
for Mixtral and Qwen3-MoE: Sluice on the 4-bit checkpoint vs transformers on its dequantized twin
(CPU, fp32); the experts kept 4-bit; offloaded == resident; quantizing at fill; refusals."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from moe_offload import fp4
from moe_offload.formats import MXFP4, NVFP4, quantize_w13
from moe_offload.offloaded import OffloadedExperts
from scheduler.generate import generate
from scheduler.messages.to_scheduler import SamplingParams
from tests.parity_helpers import cpu_runner, rel_err
from tests.tiny_fp4 import write_tiny_fp4
from tests.tiny_models import write_tiny
from worker.batch import SequenceChunk
from worker.errors import CheckpointError
from worker.expert_format import checkpoint_expert_format
from worker.expert_placement import ExpertOptions
from worker.quantization import parse_quantization
from worker.runner import ModelRunner, RunnerConfig

GENERATE = str(Path(__file__).resolve().parents[1] / "scripts" / "generate.py")
GREEDY = SamplingParams()
# K is never a multiple of 128: hidden 96 / 160, expert FFN 80 / 96 (groups of 16 / 32)
CASES = [
    dict(family="mixtral", layout="modelopt-nvfp4", hidden=96, heads=6, kv_heads=2, head_dim=16, inter=80),
    dict(family="qwen3_moe", layout="modelopt-nvfp4", hidden=160, heads=5, kv_heads=1, head_dim=32, inter=80),
    dict(family="mixtral", layout="ct-nvfp4", hidden=160, heads=5, kv_heads=5, head_dim=32, inter=48),
    dict(family="qwen3_moe", layout="ct-nvfp4", hidden=96, heads=6, kv_heads=3, head_dim=16, inter=80),
    dict(family="mixtral", layout="ct-mxfp4", hidden=160, heads=5, kv_heads=1, head_dim=32, inter=96),
    dict(family="qwen3_moe", layout="ct-mxfp4", hidden=96, heads=6, kv_heads=2, head_dim=16, inter=160),
    dict(family="qwen3_moe", layout="gptoss-mxfp4", hidden=160, heads=4, kv_heads=2, head_dim=16, inter=96),
]
FORMATS = {"modelopt-nvfp4": NVFP4, "ct-nvfp4": NVFP4, "ct-mxfp4": MXFP4, "gptoss-mxfp4": MXFP4}


@pytest.fixture(scope="module", params=CASES, ids=lambda c: f"{c['family']}-{c['layout']}-h{c['hidden']}-i{c['inter']}")
def tiny(request, tmp_path_factory):
    case = dict(request.param)
    layout = case.pop("layout")
    return layout, write_tiny_fp4(tmp_path_factory.mktemp("fp4"), case.pop("family"), layout, **case, seed=5,
                                  layers=4, experts=4, top_k=2)


def test_fp4_checkpoint_matches_transformers_on_dequantized_weights(tiny):
    layout, model = tiny
    runner = cpu_runner(model.fp4_dir)
    assert checkpoint_expert_format(model.fp4_dir) == FORMATS[layout]
    banks = runner.weights.experts
    assert banks.format == FORMATS[layout] and banks.w13.dtype == torch.uint8  # experts stay 4-bit
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 128, (n,), generator=gen).tolist() for n in (1, 9, 23)]
    pool = runner.kv_pool
    pages = [pool.allocate(pool.pages_for(len(p) + 4)) for p in prompts]
    out = runner.forward([SequenceChunk(p, 0, pg) for p, pg in zip(prompts, pages)], [GREEDY] * 3, [0] * 3)
    for b, p in enumerate(prompts):
        with torch.no_grad():
            ref = model.hf(torch.tensor([p])).logits[0, -1]
        assert rel_err(out.logits[b], ref) < 1e-4
    prompt = [5, 9, 11, 3]
    want = model.hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0, 4:].tolist()
    assert generate(runner, prompt, GREEDY, 8).token_ids == want


def test_offloaded_fp4_generation_equals_resident(tiny):
    _, model = tiny
    resident = cpu_runner(model.fp4_dir)
    # 12 of 16 slots: the prefill pipeline's 2E lent slots and E for decode; 6: decode only
    for fraction, pipelined in ((0.75, True), (0.375, False)):
        offloaded = cpu_runner(model.fp4_dir, cache_fraction=fraction)
        experts = offloaded.experts
        assert isinstance(experts, OffloadedExperts) and (experts.pipeline is not None) == pipelined
        assert experts.cache.format == resident.weights.experts.format
        for prompt in ([5, 9, 11, 3], list(range(1, 40))):  # 39 tokens x top-2 >= 4E: a pipelined prefill
            want = generate(resident, prompt, GREEDY, 8).token_ids
            assert generate(offloaded, prompt, GREEDY, 8).token_ids == want


@pytest.mark.parametrize("target", [NVFP4, MXFP4], ids=lambda f: f.name)
def test_float_experts_are_quantized_at_fill(tmp_path, target):
    """``--expert-dtype nvfp4|mxfp4`` on a float checkpoint: the banks are ``quantize_w13`` of the
    experts, bit for bit, and offloaded runs as resident does."""
    write_tiny(tmp_path, "qwen3_moe", seed=2, layers=2, hidden=96, heads=6, kv_heads=2, head_dim=16, inter=64, experts=4)
    resident = cpu_runner(tmp_path, expert_dtype=target.name)
    banks = resident.weights.experts
    src = load_file(tmp_path / "model.safetensors")
    e = "model.layers.1.mlp.experts.2."
    w13 = torch.cat([src[e + "gate_proj.weight"], src[e + "up_proj.weight"]])
    parts = quantize_w13(target, w13)
    got = [t[1, 2] for t in (banks.w13, banks.w13_scale, banks.w13_channel_scale) if t is not None]
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(got, parts))
    offloaded = cpu_runner(tmp_path, expert_dtype=target.name, cache_fraction=0.5)
    assert offloaded.experts.cache.format == target
    prompt = list(range(3, 30))
    assert generate(offloaded, prompt, GREEDY, 6).token_ids == generate(resident, prompt, GREEDY, 6).token_ids


def test_cache_slots_of_4bit_experts_hold_about_3_6x_bf16():
    from moe_offload.expert_cache import slot_bytes

    w13, w2 = (1536, 2048), (2048, 768)  # qwen3-30b-geometry
    bf16 = slot_bytes(w13, w2, torch.bfloat16)
    assert 3.5 < bf16 / slot_bytes(w13, w2, NVFP4.dtype, NVFP4.scale_block, "nvfp4") < 3.6
    assert 3.7 < bf16 / slot_bytes(w13, w2, MXFP4.dtype, MXFP4.scale_block, "mxfp4") < 3.8


# ==== refusals: one line, exit 2 from the CLIs ====

REFUSED = [
    ({"quant_method": "awq", "bits": 4, "group_size": 128}, r"unsupported quantization \(awq, 4-bit\)"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128}, r"unsupported quantization \(gptq, 4-bit\)"),
    ({"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 32}, "NVFP4 with group_size 32"),
    ({"quant_method": "modelopt", "quant_algo": "W4A8_AWQ"}, "modelopt W4A8_AWQ"),
    ({"quant_method": "mxfp4", "group_size": 16}, "mxfp4 with group_size 16"),
    ({**json.loads(json.dumps({"quant_method": "compressed-tensors", "config_groups": {"g": {"weights": {
        "num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 32}}}}))}, "group_size 32"),
    ({"quant_method": "compressed-tensors", "config_groups": {"g": {"weights": {
        "num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16, "scale_dtype": "torch.float32"}}}},
     "nvfp4 with torch.float32 scales"),
    ({"quant_method": "compressed-tensors", "config_groups": {"g": {"weights": {
        "num_bits": 4, "type": "int", "strategy": "group", "group_size": 128}}}}, "int4 weights"),
]


@pytest.mark.parametrize("qc, match", REFUSED, ids=range(len(REFUSED)))
def test_unsupported_4bit_quantization_is_refused_in_one_line(qc, match):
    with pytest.raises(CheckpointError, match=match) as err:
        parse_quantization({"quantization_config": qc}, "x/config.json")
    assert "\n" not in str(err.value)


@pytest.fixture
def ct_nvfp4(tmp_path):
    return write_tiny_fp4(tmp_path, "qwen3_moe", "ct-nvfp4", hidden=96, heads=6, kv_heads=2, head_dim=16, inter=80,
                          layers=1, experts=4)


def _rewrite(model_dir, edit):
    file = model_dir / "model.safetensors"
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


EXPERT = "model.layers.0.mlp.experts.1.up_proj."
ATTN = "model.layers.0.self_attn.o_proj."


@pytest.mark.parametrize("name", [EXPERT, ATTN], ids=["expert", "dense"])
@pytest.mark.parametrize("offload", [False, True], ids=["resident", "offloaded"])
def test_4bit_tensor_that_does_not_fit_the_config_is_refused(ct_nvfp4, name, offload):
    _rewrite(ct_nvfp4.fp4_dir, lambda t: t.update({name + "weight_packed": t[name + "weight_packed"][:, :-8].contiguous()}))
    with pytest.raises(CheckpointError, match=rf"tensor {name}weight_packed has shape \(\d+, \d+\), expected"):
        cpu_runner(ct_nvfp4.fp4_dir, **({"cache_fraction": 0.5} if offload else {}))


def test_4bit_scale_of_another_dtype_is_refused(ct_nvfp4):
    _rewrite(ct_nvfp4.fp4_dir, lambda t: t.update({EXPERT + "weight_scale": t[EXPERT + "weight_scale"].float()}))
    with pytest.raises(CheckpointError, match=rf"tensor {EXPERT}weight_scale is float32, expected float8_e4m3fn"):
        cpu_runner(ct_nvfp4.fp4_dir)


def _write_tokenizer(model_dir):
    from tokenizers import Tokenizer, models

    Tokenizer(models.WordLevel({"hi": 0, "[UNK]": 1}, unk_token="[UNK]")).save(str(model_dir / "tokenizer.json"))


def _cli(model_dir, *args):
    return subprocess.run([sys.executable, GENERATE, "--model", str(model_dir), "--prompt", "hi", "--device", "cpu",
                           "--max-tokens", "2", *args], capture_output=True, text=True, timeout=180)


def test_cli_runs_a_4bit_checkpoint_and_refuses_awq_with_exit_2(ct_nvfp4):
    path = ct_nvfp4.fp4_dir
    _write_tokenizer(path)
    assert _cli(path).returncode == 0
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "quantization_config": REFUSED[0][0]}))
    proc = _cli(path)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1
    assert lines[0].startswith(f"error: {path}/config.json: unsupported quantization (awq, 4-bit)")


def test_cli_refuses_a_misshapen_4bit_expert_with_exit_2(ct_nvfp4):
    path = ct_nvfp4.fp4_dir
    _write_tokenizer(path)
    _rewrite(path, lambda t: t.update({EXPERT + "weight_scale": t[EXPERT + "weight_scale"][:, :2].contiguous()}))
    proc = _cli(path, "--moe-cache-fraction", "0.5")
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error")]  # beside the progress bars
    assert proc.returncode == 2 and len(errors) == 1 and f"tensor {EXPERT}weight_scale has shape" in errors[0]


# ==== on a GPU ====

@pytest.mark.cuda
def test_offloaded_fp4_generation_equals_resident_on_the_gpu(tiny):
    _, model = tiny

    def gpu_runner(**experts):
        return ModelRunner(RunnerConfig(str(model.fp4_dir), device="cuda", dtype="bfloat16", page_size=16,
                                        kv_tokens=4096, cuda_graph=False, experts=ExpertOptions(**experts)))
    resident, offloaded = gpu_runner(), gpu_runner(cache_fraction=0.75)
    for prompt in ([5, 9, 11, 3], list(range(1, 40))):
        want = generate(resident, prompt, GREEDY, 8).token_ids
        assert generate(offloaded, prompt, GREEDY, 8).token_ids == want


def test_experts_a_4bit_format_cannot_hold_are_refused_before_loading(tmp_path):
    write_tiny(tmp_path, "mixtral", layers=1, hidden=64, inter=48, experts=4)
    assert cpu_runner(tmp_path, expert_dtype="nvfp4").weights.experts.format == NVFP4  # 48 = 3 groups of 16
    with pytest.raises(CheckpointError, match="--expert-dtype mxfp4: mxfp4 needs input dims that are multiples "
                                              "of 32; got 48"):
        cpu_runner(tmp_path, expert_dtype="mxfp4", cache_fraction=0.5)


def test_4bit_configs_read_into_their_schemes(tmp_path):
    from moe_offload.formats.fp4_checkpoint import FP4Scheme
    from worker.quantization import with_modelopt_config

    modelopt = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16, "exclude_modules": ["lm_head"]}
    assert parse_quantization({"quantization_config": modelopt}) == FP4Scheme(NVFP4)
    assert parse_quantization({"quantization_config": {"quant_method": "mxfp4"}}) == FP4Scheme(MXFP4)
    (tmp_path / "hf_quant_config.json").write_text(json.dumps({"quantization": {"quant_algo": "NVFP4", "group_size": 16}}))
    assert parse_quantization(with_modelopt_config(tmp_path, {})) == FP4Scheme(NVFP4)
    own = {"quantization_config": {"quant_method": "mxfp4"}}
    assert with_modelopt_config(tmp_path, own) == own  # config.json's own config wins
