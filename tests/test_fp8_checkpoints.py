"""FP8 checkpoints (Hugging Face fine-grained fp8 and compressed-tensors fp8) for Mixtral and
Qwen3-MoE: Sluice on the fp8 checkpoint vs transformers on its dequantized twin (CPU, fp32); fp8
experts kept as fp8; unsupported quantizations and misfitting scales refused in one line."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from moe_offload.fp8 import BLOCK_128, FP8_DTYPE, PER_CHANNEL, dequantize_w13, quantize, quantize_w13
from moe_offload.formats import ExpertFormat
from moe_offload.fp8_checkpoint import FP8Scheme
from moe_offload.offloaded import OffloadedExperts
from moe_offload.safetensors_file import index_files
from moe_offload.expert_names import FUSED_NAMES, QWEN3_MOE_NAMES
from moe_offload.store_fill import read_expert_layer
from moe_offload.store_layout import ExpertGeometry
from tests.parity_helpers import check_batch_decode, cpu_runner, rel_err
from tests.tiny_fp8 import LAYOUTS, assert_experts_stay_fp8, write_tiny_fp8
from worker.batch import SequenceChunk
from worker.errors import CheckpointError
from worker.expert_placement import ExpertOptions
from scheduler.generate import generate
from worker.expert_format import checkpoint_expert_format
from worker.quantization import parse_quantization
from worker.runner import ModelRunner, RunnerConfig
from scheduler.messages.to_scheduler import SamplingParams

GENERATE = str(Path(__file__).resolve().parents[1] / "scripts" / "generate.py")

GREEDY = SamplingParams()
# hidden 96 / 160 and expert FFN 80 / 144 are not multiples of the 128 block (ragged edges, and
# 144 gives each w13 half two row blocks); attention is quantized too.
CASES = [
    dict(family="mixtral", layout="hf-block", hidden=160, heads=5, kv_heads=1, head_dim=32, inter=80, experts=4),
    dict(family="mixtral", layout="ct-channel", hidden=96, heads=6, kv_heads=2, head_dim=16, inter=80, experts=8),
    dict(family="mixtral", layout="ct-tensor", hidden=96, heads=6, kv_heads=3, head_dim=16, inter=144, experts=4),
    dict(family="qwen3_moe", layout="hf-block", hidden=96, heads=6, kv_heads=2, head_dim=16, inter=144, experts=8),
    dict(family="qwen3_moe", layout="ct-channel", hidden=160, heads=5, kv_heads=5, head_dim=32, inter=80, experts=4),
    dict(family="qwen3_moe", layout="ct-block", hidden=160, heads=4, kv_heads=2, head_dim=16, inter=80, experts=8),
]


@pytest.fixture(scope="module", params=CASES, ids=lambda c: f"{c['family']}-{c['layout']}-h{c['hidden']}-i{c['inter']}")
def tiny(request, tmp_path_factory):
    case = dict(request.param)
    return case["layout"], write_tiny_fp8(tmp_path_factory.mktemp("fp8"), case.pop("family"), case.pop("layout"),
                                          **case, seed=3, layers=2, top_k=2)


def test_fp8_checkpoint_matches_transformers_on_dequantized_weights(tiny):
    layout, model = tiny
    runner = cpu_runner(model.fp8_dir)
    assert_experts_stay_fp8(runner, model.fp8_dir, layout)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 128, (n,), generator=gen).tolist() for n in (1, 9, 23)]
    check_batch_decode(runner, model.hf, prompts, steps=4)


def test_offloaded_fp8_generation_equals_resident(tiny):
    _, model = tiny
    resident = cpu_runner(model.fp8_dir)
    offloaded = cpu_runner(model.fp8_dir, cache_fraction=0.5)
    assert isinstance(offloaded.experts, OffloadedExperts)
    for prompt in ([5, 9, 11, 3], list(range(1, 20))):
        want = generate(resident, prompt, GREEDY, 8).token_ids
        assert generate(offloaded, prompt, GREEDY, 8).token_ids == want


def test_bf16_expert_dtype_dequantizes_fp8_experts(tiny):
    """``--expert-dtype bf16`` on an fp8 checkpoint: the experts are the dequantized weights."""
    _, model = tiny
    runner = cpu_runner(model.fp8_dir)
    cfg = runner.model_config
    from worker.models.weights import ModelWeights

    floats = ModelWeights.load(model.fp8_dir, cfg, torch.float32, torch.device("cpu"),
                               expert_format=ExpertFormat(torch.float32))
    banks = runner.weights.experts
    assert floats.experts.w13.dtype == torch.float32 and not floats.experts.quantized
    assert torch.equal(floats.experts.w13, dequantize_w13(banks.w13, banks.w13_scale, banks.scale_block))


# ==== reading experts into a target format (what the expert store's fill calls) ====


def _qwen_fp8_index(tmp_path, block, inter=80, hidden=160, experts=2):
    gen = torch.Generator().manual_seed(4)
    tensors, ref = {}, {}
    for e in range(experts):
        for proj, shape in (("gate_proj", (inter, hidden)), ("up_proj", (inter, hidden)), ("down_proj", (hidden, inter))):
            name = f"model.layers.0.mlp.experts.{e}.{proj}.weight"
            ref[name] = torch.randn(shape, generator=gen)
            tensors[name], tensors[name + "_scale_inv"] = quantize(ref[name], block)
    save_file(tensors, tmp_path / "model.safetensors")
    return index_files([tmp_path / "model.safetensors"]), tensors, ref


def _stacked(tensors, e, suffix=""):
    p = f"model.layers.0.mlp.experts.{e}."
    return torch.cat([tensors[p + "gate_proj.weight" + suffix], tensors[p + "up_proj.weight" + suffix]])


@pytest.mark.parametrize("block", [BLOCK_128, PER_CHANNEL], ids=["block", "channel"])
def test_fp8_experts_are_kept_bit_for_bit_with_stacked_scales(tmp_path, block):
    index, tensors, _ = _qwen_fp8_index(tmp_path, block)
    layer = read_expert_layer(index, QWEN3_MOE_NAMES, 0, ExpertGeometry(1, 2, 160, 80), ExpertFormat(FP8_DTYPE, block),
                              FP8Scheme("_scale_inv", block))
    for e in range(2):
        assert torch.equal(layer.w13[e].view(torch.uint8), _stacked(tensors, e).view(torch.uint8))
        assert torch.equal(layer.w13_scale[e], _stacked(tensors, e, "_scale_inv"))
        down = f"model.layers.0.mlp.experts.{e}.down_proj.weight"
        assert torch.equal(layer.w2[e].view(torch.uint8), tensors[down].view(torch.uint8))
        assert torch.equal(layer.w2_scale[e], tensors[down + "_scale_inv"])


def test_float_experts_are_quantized_for_an_fp8_target(tmp_path):
    _, _, ref = _qwen_fp8_index(tmp_path, BLOCK_128)
    save_file(ref, tmp_path / "float.safetensors")
    index = index_files([tmp_path / "float.safetensors"])
    layer = read_expert_layer(index, QWEN3_MOE_NAMES, 0, ExpertGeometry(1, 2, 160, 80), ExpertFormat(FP8_DTYPE, BLOCK_128))
    want_q, want_s = quantize_w13(_stacked(ref, 1), BLOCK_128)
    assert torch.equal(layer.w13[1].float(), want_q.float()) and torch.equal(layer.w13_scale[1], want_s)


def test_reblocking_fp8_experts_is_refused(tmp_path):
    index, _, _ = _qwen_fp8_index(tmp_path, PER_CHANNEL)
    with pytest.raises(ValueError, match="fp8-ch scales cannot run as fp8-b128x128"):
        read_expert_layer(index, QWEN3_MOE_NAMES, 0, ExpertGeometry(1, 2, 160, 80), ExpertFormat(FP8_DTYPE, BLOCK_128),
                          FP8Scheme("_scale_inv", PER_CHANNEL))


def test_fused_fp8_experts_are_refused(tmp_path):
    """A fused ``gate_up_proj`` has one scale grid over ``[2I, H]``, not one per half."""
    gen = torch.Generator().manual_seed(5)
    tensors = {}
    for name, shape in (("gate_up_proj", (2, 160, 96)), ("down_proj", (2, 96, 80))):
        q, scale = quantize(torch.randn(shape, generator=gen), BLOCK_128)
        tensors[f"model.layers.0.mlp.experts.{name}"], tensors[f"model.layers.0.mlp.experts.{name}_scale_inv"] = q, scale
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"fused fp8 experts \(model\.layers\.0\.mlp\.experts\.gate_up_proj\)"):
        read_expert_layer(index_files([tmp_path / "model.safetensors"]), FUSED_NAMES, 0, ExpertGeometry(1, 2, 96, 80),
                          ExpertFormat(FP8_DTYPE, BLOCK_128), FP8Scheme("_scale_inv", BLOCK_128))


def test_float_experts_beside_fp8_attention_stay_float(tmp_path):
    model = write_tiny_fp8(tmp_path, "mixtral", "hf-block", quantize_experts=False, hidden=96, inter=80, layers=1)
    assert checkpoint_expert_format(model.fp8_dir) == ExpertFormat(torch.float32)
    runner = cpu_runner(model.fp8_dir)
    assert runner.weights.experts.w13.dtype == torch.float32
    ids = list(range(3, 20))
    with torch.no_grad():
        ref = model.hf(torch.tensor([ids])).logits[0, -1]
    pool = runner.kv_pool
    out = runner.forward([SequenceChunk(ids, 0, pool.allocate(pool.pages_for(len(ids))))], [GREEDY], [0])
    assert rel_err(out.logits[0], ref) < 1e-4


# ==== refusals ====


GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True}
REFUSED = [
    (GPTQ, r"unsupported quantization \(gptq, 4-bit\)"),
    ({"quant_method": "awq", "w_bit": 4, "q_group_size": 128}, r"\(awq, 4-bit\)"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, r"\(bitsandbytes, 4-bit\)"),
    ({**LAYOUTS["hf-block"].quantization_config, "activation_scheme": "static"}, "fp8 with static activation scales"),
    ({**LAYOUTS["hf-block"].quantization_config, "weight_block_size": [64, 64]}, r"weight_block_size \[64, 64\]"),
    ({**LAYOUTS["hf-block"].quantization_config, "scale_fmt": "ue8m0"}, "ue8m0 scales"),
]


def _ct_with(**weights):
    qc = json.loads(json.dumps(LAYOUTS["ct-channel"].quantization_config))
    qc["config_groups"]["group_0"]["weights"].update(weights)
    return qc


REFUSED += [
    (_ct_with(type="int", num_bits=4, strategy="group", group_size=128), "compressed-tensors int4 weights"),
    (_ct_with(type="int", num_bits=8), "compressed-tensors int8 weights"),
    (_ct_with(strategy="group", group_size=128), "strategy 'group'"),
    (_ct_with(strategy="block", block_structure=[64, 128]), r"strategy 'block' \[64, 128\]"),
]


@pytest.mark.parametrize("qc, match", REFUSED, ids=range(len(REFUSED)))
def test_unsupported_quantization_is_refused_in_one_line(qc, match):
    with pytest.raises(CheckpointError, match=match) as err:
        parse_quantization({"quantization_config": qc}, "x/config.json")
    assert "\n" not in str(err.value) and "Sluice runs fp8" in str(err.value)


def test_static_activation_scales_are_refused():
    qc = LAYOUTS["ct-channel"].quantization_config
    group = {**qc["config_groups"]["group_0"], "input_activations": {"num_bits": 8, "type": "float", "dynamic": False}}
    with pytest.raises(CheckpointError, match="static activation scales"):
        parse_quantization({"quantization_config": {**qc, "config_groups": {"group_0": group}}})


@pytest.fixture
def hf_block(tmp_path):
    return write_tiny_fp8(tmp_path, "qwen3_moe", "hf-block", hidden=160, inter=80, layers=1, experts=4)


def _write_tokenizer(model_dir):
    from tokenizers import Tokenizer, models

    Tokenizer(models.WordLevel({"hi": 0, "[UNK]": 1}, unk_token="[UNK]")).save(str(model_dir / "tokenizer.json"))


def test_cli_refuses_gptq_with_exit_2(hf_block):
    path = hf_block.fp8_dir
    _write_tokenizer(path)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "quantization_config": GPTQ}))
    proc = subprocess.run([sys.executable, GENERATE, "--model", str(path), "--prompt", "hi",
                           "--device", "cpu", "--max-tokens", "2"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {path}/config.json: unsupported quantization (gptq, 4-bit)")


def test_cli_runs_an_fp8_checkpoint(hf_block):
    _write_tokenizer(hf_block.fp8_dir)
    proc = subprocess.run([sys.executable, GENERATE, "--model", str(hf_block.fp8_dir), "--prompt", "hi",
                           "--device", "cpu", "--max-tokens", "3"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def _rewrite(model_dir, edit):
    file = model_dir / "model.safetensors"
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


@pytest.mark.parametrize("name", ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.experts.2.up_proj.weight"])
@pytest.mark.parametrize("offload", [False, True], ids=["resident", "offloaded"])
def test_scale_that_does_not_fit_its_weight_is_refused(hf_block, name, offload):
    def edit(t):
        t[name + "_scale_inv"] = torch.ones(3, 3)
    _rewrite(hf_block.fp8_dir, edit)
    with pytest.raises(CheckpointError, match=rf"scale {name}_scale_inv \(float32 \[3, 3\]\) does not fit fp8 weight "
                                              rf"{name} \[\d+, 160\]: want a float scale of shape \[\d, 2\]"):
        cpu_runner(hf_block.fp8_dir, **({"cache_fraction": 0.5} if offload else {}))


def test_missing_scale_is_named(hf_block):
    name = "model.layers.0.self_attn.o_proj.weight"
    _rewrite(hf_block.fp8_dir, lambda t: t.pop(name + "_scale_inv"))
    with pytest.raises(CheckpointError, match=rf"fp8 tensor {name} has no scale {name}_scale_inv"):
        cpu_runner(hf_block.fp8_dir)


def test_fp8_tensors_without_quantization_config_are_refused(hf_block):
    cfg = json.loads((hf_block.fp8_dir / "config.json").read_text())
    del cfg["quantization_config"]
    (hf_block.fp8_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="float8_e4m3fn but config.json has no quantization_config"):
        cpu_runner(hf_block.fp8_dir)


# ==== on a GPU ====


@pytest.mark.cuda
def test_fp8_weights_load_onto_the_gpu_as_onto_the_host(tiny):
    """Dense fp8 weights are dequantized on the device they land on: bit for bit the host's result."""
    from worker.models.weights import ModelWeights

    _, model = tiny
    cfg = cpu_runner(model.fp8_dir).model_config
    host = ModelWeights.load(model.fp8_dir, cfg, torch.float32, torch.device("cpu"))
    device = ModelWeights.load(model.fp8_dir, cfg, torch.float32, torch.device("cuda"))
    on_device = device.targets(cfg).direct
    for name, tensor in host.targets(cfg).direct.items():
        assert torch.equal(on_device[name].cpu(), tensor), name
    for mine, theirs in zip(host.experts[:4], device.experts[:4]):
        assert torch.equal(theirs.cpu().view(torch.uint8), mine.view(torch.uint8))


@pytest.mark.cuda
def test_offloaded_fp8_generation_equals_resident_on_the_gpu(tiny):
    _, model = tiny

    def gpu_runner(**experts):
        return ModelRunner(RunnerConfig(str(model.fp8_dir), device="cuda", dtype="float32", page_size=16,
                                        kv_tokens=1024, experts=ExpertOptions(**experts)))

    resident, offloaded = gpu_runner(), gpu_runner(cache_fraction=0.5)
    assert resident.weights.experts.quantized
    for prompt in ([5, 9, 11, 3], list(range(1, 30))):
        want = generate(resident, prompt, GREEDY, 12).token_ids
        assert generate(offloaded, prompt, GREEDY, 12).token_ids == want
