"""Sluice's gpt-oss against Hugging Face transformers' ``GptOssForCausalLM`` (eager attention, the
one with sinks) on tiny random checkpoints (CPU, fp32): sinks and biases far from zero, a window
shorter than the prompts; ragged, chunked and decode steps past the window, greedy text, a second
turn from the prefix cache, the released MXFP4 layout, and what Sluice refuses."""
from __future__ import annotations

import copy
import json

import pytest
import torch

from scheduler.engine import Engine, EngineConfig
from tests.parity_helpers import (check_chunks_then_decode, check_decode_batch, check_prefill_batch, greedy_tokens,
                                  random_ids)
from tests.test_engine import req, run
from tests.tiny_gpt_oss import FULL, SLIDING, hf_greedy, hf_logits, write_tiny_gpt_oss, write_tiny_gpt_oss_mxfp4
from worker.config import ModelConfig
from worker.errors import CheckpointError
from worker.runner import ModelRunner, RunnerConfig
from worker.runner_config import ExpertOptions

# window 8 (shorter than every multi-token prompt below) and 5; GQA 2 and 4; YaRN and plain rope
SHAPES = {
    "SF-gqa2-w8-yarn": dict(seed=0, layer_types=(SLIDING, FULL)),
    "FSSF-gqa4-w5-d32-top2": dict(seed=1, layer_types=(FULL, SLIDING, SLIDING, FULL), heads=8, kv_heads=2,
                                  head_dim=32, window=5, top_k=2, experts=4),
    "SS-mha-w8-norope-scaling": dict(seed=2, layer_types=(SLIDING, SLIDING), heads=4, kv_heads=4, yarn=False),
}


@pytest.fixture(scope="module", params=list(SHAPES.values()), ids=list(SHAPES))
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt_oss")
    return path, write_tiny_gpt_oss(path, **request.param)


@pytest.fixture
def tiny(checkpoint):
    path, hf = checkpoint
    return hf, ModelRunner(RunnerConfig(str(path), device="cpu", dtype="float32", page_size=4, kv_tokens=512))


def test_the_checkpoint_exercises_every_part(checkpoint):
    """Sinks and biases far from zero, and the clamps bite: otherwise parity proves little."""
    _, hf = checkpoint
    attn, experts = hf.model.layers[0].self_attn, hf.model.layers[0].mlp.experts
    assert attn.sinks.abs().mean() > 0.5 and attn.q_proj.bias.abs().mean() > 0.2
    assert experts.gate_up_proj_bias.abs().mean() > 0.2 and experts.down_proj_bias.abs().mean() > 0.2
    h = hf.model.embed_tokens(torch.tensor(random_ids(64, seed=5)))
    with torch.no_grad():
        gate_up = hf.model.layers[0].post_attention_layernorm(h) @ experts.gate_up_proj[0]
    assert (gate_up[:, ::2] > 7).any() and (gate_up[:, 1::2].abs() > 7).any()


def test_ragged_prefill_matches_hf(tiny):
    hf, runner = tiny
    prompts = [random_ids(n, seed=n) for n in (1, 7, 13, 22)]
    check_prefill_batch(runner, prompts, [hf_logits(hf, p)[-1] for p in prompts])


@pytest.mark.parametrize("length,ends", [(40, (9, 21)), (40, (1, 3, 6, 10, 15, 21)), (40, (4, 8, 12, 16))],
                         ids=lambda v: "-".join(map(str, v)) if isinstance(v, tuple) else str(v))
def test_chunked_prefill_then_decode_past_the_window(tiny, length, ends):
    """Every chunk reads the prefix's pages; every step's logits equal the full forward's."""
    hf, runner = tiny
    ids = random_ids(length, seed=length)
    check_chunks_then_decode(runner, ids, hf_logits(hf, ids), ends)


def test_mixed_decode_batch_matches_hf(tiny):
    hf, runner = tiny
    lengths, decode = (3, 10, 17, 30), 3
    seqs = [random_ids(n + decode, seed=100 + n) for n in lengths]
    check_decode_batch(runner, seqs, lengths, decode, [hf_logits(hf, s) for s in seqs])


def test_greedy_text_matches_hf(tiny):
    """Two prompts generate 32 tokens each, batched, feeding back the runner's own tokens."""
    hf, runner = tiny
    prompts, n = [random_ids(6, seed=3), random_ids(11, seed=4)], 32
    want = [hf_greedy(hf, p, n) for p in prompts]
    assert greedy_tokens(runner, prompts, n) == want


def test_second_turn_from_the_prefix_cache(checkpoint):
    """The engine serves two turns; the second's prompt is the first's, its reply and new tokens,
    so it prefills only past the cached prefix (in chunks of 8), and answers as transformers."""
    path, hf = checkpoint
    runner = ModelRunner(RunnerConfig(str(path), device="cpu", dtype="float32", page_size=4, kv_tokens=1024,
                                      max_prefill_tokens=8))
    engine = Engine(runner, EngineConfig(max_running=4))
    history = random_ids(19, seed=7)
    for turn in range(2):
        out = run(engine, [req(f"t{turn}", history, max_tokens=12, ignore_eos=True)])[f"t{turn}"]
        assert out[0] == hf_greedy(hf, history, 12), f"turn {turn}"
        cached = sum(u.cached_prompt_tokens for u in out[2])
        assert cached >= (len(history) - 1) // 4 * 4 if turn else cached == 0, (turn, cached)
        history = history + out[0] + random_ids(9, seed=8 + turn)


# ==== what the family reads, and what it refuses in one line ====

@pytest.fixture(scope="module")
def config(checkpoint) -> dict:
    path, _ = checkpoint
    return json.loads((path / "config.json").read_text())


def test_config_reads_the_family(config):
    cfg = ModelConfig.from_dict(copy.deepcopy(config))
    assert cfg.family == "gpt_oss" and cfg.expert_activation == "gpt_oss" and cfg.attention_sinks
    assert [cfg.window(i) for i in range(cfg.num_layers)] == [
        config["sliding_window"] if t == SLIDING else 0 for t in config["layer_types"]]


def other_limit(raw: dict) -> None:
    raw["swiglu_limit"] = 10.0


def unknown_layer(raw: dict) -> None:
    raw["layer_types"] = raw["layer_types"][:-1] + ["chunked_attention"]


def longrope(raw: dict) -> None:
    raw["rope_parameters"] = {"rope_type": "longrope", "rope_theta": 150000.0}


@pytest.mark.parametrize("edit,named", [(other_limit, "swiglu_limit"),
                                        (unknown_layer, "chunked_attention"), (longrope, "longrope")])
def test_unsupported_config_is_refused(config, edit, named):
    raw = copy.deepcopy(config)
    edit(raw)
    with pytest.raises(CheckpointError) as refused:
        ModelConfig.from_dict(raw)
    message = str(refused.value)
    assert named in message and "\n" not in message, message


# ==== the released MXFP4 layout ====

@pytest.fixture(scope="module")
def mxfp4_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    return path, write_tiny_gpt_oss_mxfp4(path, seed=3, layer_types=(SLIDING, FULL, SLIDING))


def test_mxfp4_checkpoint_matches_transformers_on_its_dequantized_weights(mxfp4_checkpoint):
    """Experts kept in MXFP4 (the eager twin dequantizes them); prefill in chunks, then decode past
    the window, against transformers with the experts it dequantizes from the same blocks."""
    path, hf = mxfp4_checkpoint
    runner = ModelRunner(RunnerConfig(str(path), device="cpu", dtype="float32", page_size=4, kv_tokens=256))
    assert runner.expert_format.name == "mxfp4"
    ids = random_ids(30, seed=11)
    check_chunks_then_decode(runner, ids, hf_logits(hf, ids), (9, 20))


def test_fp8_experts_of_gpt_oss_are_refused(checkpoint):
    path, _ = checkpoint
    with pytest.raises(CheckpointError, match="fp8 experts with biases"):
        ModelRunner(RunnerConfig(str(path), device="cpu", dtype="float32", page_size=4, kv_tokens=64,
                                 experts=ExpertOptions(expert_dtype="fp8")))


def test_triton_backend_routes_gpt_oss_through_the_paged_paths(checkpoint):
    """The "triton" backend (here its twins, on the CPU): every prefill, with a prefix or not, goes
    through the paged prefill with sinks and windows, decode through the paged decode."""
    path, hf = checkpoint
    runner = ModelRunner(RunnerConfig(str(path), device="cpu", dtype="float32", page_size=4, kv_tokens=256,
                                      attention="triton"))
    ids = random_ids(30, seed=12)
    check_chunks_then_decode(runner, ids, hf_logits(hf, ids), (13, 25))


def test_generation_config_adds_its_stop_ids(checkpoint, tmp_path):
    """gpt-oss's generation_config.json names <|call|> and <|endoftext|> beside config.json's
    <|return|>: a tool call must end the reply too."""
    path, _ = checkpoint
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [127, 120, 125]}))
    assert ModelConfig.from_dir(tmp_path).eos_token_ids == (127, 120, 125)
