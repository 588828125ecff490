"""Sluice's hybrid models (Gated DeltaNet and full attention: Qwen3.5-MoE, Qwen3-Next) against
Hugging Face transformers on tiny random checkpoints (CPU, fp32): ragged, chunked and mixed steps,
decode, greedy text, recurrent-state snapshots, and the configs Sluice refuses."""
from __future__ import annotations

import copy
import json
import re

import pytest

from tests.parity_helpers import (check, check_chunks_then_decode, check_decode_batch, check_prefill_batch,
                                  greedy_tokens, pages, random_ids, step)
from tests.tiny_hybrid import FAMILIES, hf_greedy, hf_logits, write_tiny_hybrid
from worker.batch import SequenceChunk
from worker.config import ModelConfig
from worker.errors import CheckpointError
from worker.runner import ModelRunner, RunnerConfig

L, F = "linear_attention", "full_attention"

# GQA heads/kv_heads 1, 2, 4; linear value heads 1x, 2x, 4x the key heads; head_dim 16 and 32 with
# a quarter or half of it rotated; Qwen3.5 as the released VLM and as a causal LM, experts saved
# one by one and fused
SHAPES = {
    "q35vlm-LF": dict(family="qwen3_5_moe", seed=0, layer_types=(L, F)),
    "q35vlm-LLLLF-gqa4-v4x-d32-fused": dict(
        family="qwen3_5_moe", seed=1, layer_types=(L, L, L, L, F), heads=8, kv_heads=2, linear_k_heads=2,
        linear_v_heads=8, head_dim=32, partial_rotary_factor=0.5, experts=4, top_k=3, fused_experts=True),
    "q35-FLL-gqa1-v1x-d32": dict(
        family="qwen3_5_moe_causal", seed=2, layer_types=(F, L, L), heads=4, kv_heads=4, linear_k_heads=2,
        linear_v_heads=2, head_dim=32, partial_rotary_factor=0.5),
    "q35-LFLF-gqa2-v2x-kd8vd16-top1": dict(
        family="qwen3_5_moe_causal", seed=3, layer_types=(L, F, L, F), heads=6, kv_heads=3, linear_k_heads=4,
        linear_v_heads=8, linear_k_dim=8, linear_v_dim=16, top_k=1),
    "next-LLLF-gqa4-v4x-norenorm": dict(
        family="qwen3_next", seed=4, layer_types=(L, L, L, F), heads=8, kv_heads=2, linear_k_heads=2,
        linear_v_heads=8, norm_topk_prob=False, experts=16, top_k=4),
    "next-LFLF-gqa1-v1x-d32-fused": dict(
        family="qwen3_next", seed=5, layer_types=(L, F, L, F), heads=4, kv_heads=4, linear_k_heads=2,
        linear_v_heads=2, head_dim=32, partial_rotary_factor=0.5, fused_experts=True),
    "next-FL-gqa4-v2x": dict(family="qwen3_next", seed=6, layer_types=(F, L), heads=4, kv_heads=1),
}


@pytest.fixture(scope="module", params=list(SHAPES.values()), ids=list(SHAPES))
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("hybrid")
    return path, write_tiny_hybrid(path, **request.param)


@pytest.fixture
def tiny(checkpoint):
    """The HF model and a fresh runner on its checkpoint (KV pages and state slots all free)."""
    path, hf = checkpoint
    return hf, ModelRunner(RunnerConfig(str(path), device="cpu", dtype="float32", page_size=4, kv_tokens=256))


def test_ragged_prefill_matches_hf(tiny):
    hf, runner = tiny
    prompts = [random_ids(n, seed=n) for n in (1, 7, 13, 22)]
    check_prefill_batch(runner, prompts, [hf_logits(hf, p)[-1] for p in prompts], state_slots=[1, 2, 3, 4])


# (length, ends of the prefill chunks): then decode to the end. 150 tokens: chunks of exactly 64
# from position 0, and a 130-token chunk that starts off the 64 grid with a state carried in
@pytest.mark.parametrize("length,ends", [(30, (9, 21)), (30, (4, 8, 12, 16)), (30, (1, 3, 6, 10, 15, 21)),
                                         (150, (64, 128, 140)), (150, (3, 133, 145))],
                         ids=lambda v: "-".join(map(str, v)) if isinstance(v, tuple) else str(v))
def test_chunked_prefill_then_decode_match_full_forward(tiny, length, ends):
    """Every chunk continues the state its slot holds; every step's logits equal the full
    forward's at that position."""
    hf, runner = tiny
    ids = random_ids(length, seed=length)
    check_chunks_then_decode(runner, ids, hf_logits(hf, ids), ends, state_slot=1)


def test_mixed_decode_batch_matches_hf(tiny):
    """Sequences at different lengths (one past a 64-token chunk) decode together."""
    hf, runner = tiny
    lengths, decode = (3, 10, 17, 70), 3
    seqs = [random_ids(n + decode, seed=100 + n) for n in lengths]
    check_decode_batch(runner, seqs, lengths, decode, [hf_logits(hf, s) for s in seqs], state_slots=[1, 2, 3, 4])


def test_greedy_text_matches_hf(tiny):
    """Two prompts generate 32 tokens each, batched, feeding back the runner's own tokens."""
    hf, runner = tiny
    prompts, n = [random_ids(6, seed=3), random_ids(11, seed=4)], 32
    want = [hf_greedy(hf, p, n) for p in prompts]
    assert greedy_tokens(runner, prompts, n, state_slots=[1, 2]) == want


def test_state_snapshot_resumes(tiny):
    """A 20-token prefix in slot 1 is copied to slot 2 (which continues beside slot 1) and to
    slot 3 (kept aside, resumed after both have moved on): each continuation matches HF. The
    prefix's KV pages are shared, as the prefix cache shares them."""
    hf, runner = tiny
    prefix = random_ids(20, seed=20)
    conts = [random_ids(7, seed=21 + i) for i in range(3)]
    refs = [hf_logits(hf, prefix + c) for c in conts]
    shared = pages(runner, len(prefix))
    assert len(shared) * runner.page_size == len(prefix)  # whole pages: each continuation appends its own
    step(runner, [SequenceChunk(prefix, 0, shared, state_slot=1)])
    runner.state_pool.copy([1, 1], [2, 3])
    own = [shared + pages(runner, len(c)) for c in conts]

    def resume(slots: list[int]) -> None:
        out = step(runner, [SequenceChunk(conts[s - 1][:4], 20, own[s - 1], state_slot=s) for s in slots])
        for b, s in enumerate(slots):
            check(out.logits[b], refs[s - 1][23], f"slot {s}, chunk 20:24")
        for pos in range(24, 27):
            out = step(runner, [SequenceChunk([conts[s - 1][pos - 20]], pos, own[s - 1], state_slot=s) for s in slots])
            for b, s in enumerate(slots):
                check(out.logits[b], refs[s - 1][pos], f"slot {s}, decode at {pos}")

    resume([1, 2])
    resume([3])


def test_mixed_prefill_and_decode_step(tiny):
    """One step holds chunks that continue a state (prefix > 0), chunks that start one (prefix 0,
    in a slot an earlier sequence left dirty; one of a single token) and decode tokens."""
    hf, runner = tiny
    seqs = {slot: random_ids(n, seed=60 + slot) for slot, n in ((1, 16), (2, 9), (3, 9), (4, 20), (5, 2))}
    refs = {slot: hf_logits(hf, toks) for slot, toks in seqs.items()}
    seq_pages = {slot: pages(runner, len(toks)) for slot, toks in seqs.items()}
    junk = random_ids(12, seed=99)  # leaves slot 3 dirty
    step(runner, [SequenceChunk(seqs[1][:10], 0, seq_pages[1], state_slot=1),
                  SequenceChunk(seqs[2][:7], 0, seq_pages[2], state_slot=2),
                  SequenceChunk(junk, 0, pages(runner, len(junk)), state_slot=3),
                  SequenceChunk(seqs[4][:13], 0, seq_pages[4], state_slot=4)])
    # each step's (slot, prefix_len, new tokens): a chunk, a decode, a fresh 9, a chunk, a fresh 1;
    # then every sequence but the fresh 9 decodes
    for i, rows in enumerate([[(1, 10, 5), (2, 7, 1), (3, 0, 9), (4, 13, 6), (5, 0, 1)],
                              [(1, 15, 1), (2, 8, 1), (4, 19, 1), (5, 1, 1)]]):
        out = step(runner, [SequenceChunk(seqs[s][p:p + n], p, seq_pages[s], state_slot=s) for s, p, n in rows])
        for row, (s, p, n) in enumerate(rows):
            check(out.logits[row], refs[s][p + n - 1], f"step {i}, slot {s}, tokens {p}:{p + n}")


def test_snapshot_inside_a_chunk(tiny):
    """A step whose chunks snapshot their linear layers' state inside them (the prompt-end snapshot
    of the prefix cache): the logits are those of a step without, and each snapshot resumes as the
    prefix it ends. Splits of a first and a middle sequence reorder the tokens; one tail is a single
    token; one chunk continues a state, another starts one."""
    hf, runner = tiny
    seqs = {slot: random_ids(n, seed=80 + slot) for slot, n in ((1, 22), (2, 9), (3, 17), (4, 18))}
    seq_pages = {slot: pages(runner, len(toks) + 6) for slot, toks in seqs.items()}
    step(runner, [SequenceChunk(seqs[4][:8], 0, seq_pages[4], state_slot=4)])
    # (slot, prefix_len, new tokens, snapshot after how many of them, into which slot)
    rows = [(1, 0, 22, 12, 6), (2, 0, 9, None, None), (3, 0, 17, 16, 7), (4, 8, 10, 3, 8)]
    chunks = [SequenceChunk(seqs[s][p:p + n], p, seq_pages[s], state_slot=s,
                            state_snapshot=None if cut is None else (cut, into)) for s, p, n, cut, into in rows]
    out = step(runner, chunks)
    for row, (s, p, n, _, _) in enumerate(rows):
        check(out.logits[row], hf_logits(hf, seqs[s])[p + n - 1], f"slot {s}, tokens {p}:{p + n}")
    for s, p, _, cut, into in rows:
        if cut is None:
            continue
        end = p + cut  # the snapshot's sequence: seqs[s][:end], then a continuation of its own
        cont = random_ids(5, seed=90 + s)
        out = step(runner, [SequenceChunk(cont, end, seq_pages[s], state_slot=into)])
        check(out.logits[0], hf_logits(hf, seqs[s][:end] + cont)[-1], f"snapshot of slot {s} after {end}")


@pytest.mark.parametrize("snapshot,why", [((0, 9), "inside the chunk"), ((5, 9), "inside the chunk"),
                                          ((2, 1), "no sequence runs in"), ((2, 2), "no sequence runs in")])
def test_a_snapshot_outside_its_chunk_or_into_a_running_slot_is_refused(tiny, snapshot, why):
    _, runner = tiny
    chunks = [SequenceChunk(random_ids(5, seed=1), 0, pages(runner, 5), state_slot=1, state_snapshot=snapshot),
              SequenceChunk(random_ids(3, seed=2), 0, pages(runner, 3), state_slot=2)]
    with pytest.raises(ValueError, match=why):
        step(runner, chunks)


def test_two_snapshots_into_one_slot_are_refused(tiny):
    _, runner = tiny
    chunks = [SequenceChunk(random_ids(5, seed=s), 0, pages(runner, 5), state_slot=s, state_snapshot=(2, 9))
              for s in (1, 2)]
    with pytest.raises(ValueError, match="share a slot"):
        step(runner, chunks)


# ==== refusals: one line naming what Sluice does not run ====

def unknown_layer_kind(text: dict) -> None:
    text["layer_types"] = text["layer_types"][:-1] + ["mamba"]


def yarn(text: dict) -> None:
    text["rope_parameters"].update(rope_type="yarn", factor=4.0, original_max_position_embeddings=128)


def attention_bias(text: dict) -> None:
    text["attention_bias"] = True


@pytest.fixture(scope="module")
def configs(tmp_path_factory) -> dict[str, dict]:
    """Each family's config.json, as written."""
    raw = {}
    for family in FAMILIES:
        path = tmp_path_factory.mktemp(family)
        write_tiny_hybrid(path, family)
        raw[family] = json.loads((path / "config.json").read_text())
    return raw


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("edit,named", [(unknown_layer_kind, "mamba"), (yarn, "yarn"),
                                        (attention_bias, "attention.bias")], ids=["layer-kind", "yarn", "bias"])
def test_unsupported_config_is_refused(configs, family, edit, named):
    raw = copy.deepcopy(configs[family])
    ModelConfig.from_dict(copy.deepcopy(raw))  # as written, it runs
    edit(raw.get("text_config", raw))  # the VLM keeps the text model's fields under text_config
    with pytest.raises(CheckpointError) as refused:
        ModelConfig.from_dict(raw)
    message = str(refused.value)
    assert re.search(named, message, re.IGNORECASE), message
    assert "\n" not in message
