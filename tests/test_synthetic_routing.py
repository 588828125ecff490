"""The synthetic router: its statistics against the Qwen3-30B-A3B targets, the same routing for a
token whether prefilled or decoded, distinct ids; the hook in the model (``--routing synthetic``),
record -> replay of a trace; on a GPU the router captured in a CUDA graph, sync-free."""
from __future__ import annotations

import pytest
import torch

from moe_offload.routing_trace import RoutingTrace
from moe_offload.synthetic_routing import SyntheticRouter, TokenKeys, routing_statistics, synthetic_trace
from worker.expert_placement import ExpertOptions
from scheduler.generate import generate
from worker.routing_options import RoutingOptions
from worker.runner import ModelRunner, RunnerConfig
from scheduler.messages.to_scheduler import SamplingParams

# published Qwen3-30B-A3B decode statistics (E = 128, k = 8)
TARGETS = {"repeat_next": 0.45, "repeat_within": 0.80, "head_mass": 0.90, "top_share": 0.05}


def keys_for(sequences: int, tokens: int, device="cpu", seed: int = 0) -> TokenKeys:
    gen = torch.Generator().manual_seed(seed)
    seq = torch.arange(1, sequences + 1).repeat_interleave(tokens)
    pos = torch.arange(tokens).repeat(sequences)
    ids = torch.randint(0, 1000, (sequences * tokens,), generator=gen)
    return TokenKeys(seq.to(device), pos.to(device), ids.to(device))


@pytest.mark.parametrize("seed", [0, 1])
def test_statistics_match_qwen3_targets(seed):
    stats = routing_statistics(synthetic_trace(6, 128, 8, sequences=8, tokens=160, seed=seed), 128)
    assert stats["head"] == 60
    for name, target in TARGETS.items():
        assert abs(stats[name] - target) <= 0.05, (name, stats)
    assert abs(stats["top_share"] - 0.05) <= 0.01, stats


def test_prefill_and_decode_route_a_token_alike():
    router = SyntheticRouter(3, 32, 4, "cpu", seed=3)
    keys = keys_for(2, 40)
    w_all, ids_all = router.route(slice(None), keys)
    for t in (0, 1, 17, 39, 55, 79):  # one token at a time, one layer at a time
        one = TokenKeys(*(k[t:t + 1] for k in keys))
        for layer in range(3):
            w, ids = router.route(slice(layer, layer + 1), one)
            assert torch.equal(ids[0], ids_all[layer, t:t + 1])
            torch.testing.assert_close(w[0], w_all[layer, t:t + 1])


@pytest.mark.parametrize("experts, top_k", [(8, 2), (16, 4), (64, 6), (128, 8), (256, 16)])
def test_ids_are_distinct_experts_and_weights_sum_to_one(experts, top_k):
    weights, ids = SyntheticRouter(2, experts, top_k, "cpu").route(slice(None), keys_for(3, 50))
    assert ids.shape == (2, 150, top_k) and ids.dtype == torch.int64
    assert int(ids.min()) >= 0 and int(ids.max()) < experts
    assert bool((torch.sort(ids, dim=2).values.diff(dim=2) > 0).all())  # distinct per token
    torch.testing.assert_close(weights.sum(dim=2), torch.ones(2, 150))
    assert bool((weights > 0).all())


def test_sequences_and_layers_differ():
    ids = synthetic_trace(2, 128, 8, sequences=2, tokens=64)
    assert not torch.equal(ids[0], ids[1]) and not torch.equal(ids[:, 0], ids[:, 1])


# ==== in the model ====

def runner(routing: RoutingOptions, dummy: bool = True, **kw) -> ModelRunner:
    return ModelRunner(RunnerConfig("tiny-geometry", device="cpu", dtype="float32", page_size=4, kv_tokens=256,
                                    experts=ExpertOptions(cache_fraction=0.5, dummy_weights=dummy), routing=routing,
                                    **kw))


def test_synthetic_routing_needs_dummy_weights(tmp_path):
    from tests.tiny_models import write_tiny

    write_tiny(tmp_path, "qwen3", layers=2, experts=8, top_k=2)
    with pytest.raises(ValueError, match="needs --dummy-weights"):
        ModelRunner(RunnerConfig(str(tmp_path), device="cpu", dtype="float32", kv_tokens=64,
                                 routing=RoutingOptions("synthetic")))
    with pytest.raises(ValueError, match="not one of"):
        runner(RoutingOptions("random"))


def test_model_routes_synthetically_and_replays_its_record(tmp_path):
    prompt, params = list(range(3, 40)), SamplingParams()
    path = str(tmp_path / "trace.pt")
    synthetic = runner(RoutingOptions("synthetic", record=path, seed=5))
    tokens = generate(synthetic, prompt, params, 12).token_ids
    synthetic.save_routing_record()
    trace = RoutingTrace.load(path)
    cfg = synthetic.model_config
    assert trace.ids.shape == (len(prompt) + 11, cfg.num_layers, cfg.top_k)  # prefill + 11 decode steps
    assert trace.step.unique().numel() == 12
    # what the model routed is the synthetic router's choice for those tokens
    router = SyntheticRouter(cfg.num_layers, cfg.num_experts, cfg.top_k, "cpu", seed=5)
    keys = TokenKeys(trace.sequence, trace.position, torch.tensor(prompt + tokens[:11]))
    assert torch.equal(router.route(slice(None), keys)[1].transpose(0, 1), trace.ids)

    model_path = str(tmp_path / "model.pt")
    own = runner(RoutingOptions("model", record=model_path))
    generate(own, prompt, params, 12)
    own.save_routing_record()
    assert not torch.equal(RoutingTrace.load(model_path).ids, trace.ids)

    replay_path = str(tmp_path / "replay.pt")
    replay = runner(RoutingOptions(f"replay:{path}", record=replay_path))
    assert generate(replay, prompt, params, 12).token_ids == tokens
    replay.save_routing_record()
    replayed = RoutingTrace.load(replay_path)
    assert torch.equal(replayed.ids, trace.ids) and torch.equal(replayed.weights, trace.weights)
    assert int(replay.model.routing.inner.missing) == 0


def test_replay_refuses_a_trace_of_another_shape(tmp_path):
    trace = RoutingTrace(8, torch.zeros(1, dtype=torch.long), torch.ones(1, dtype=torch.long),
                         torch.zeros(1, dtype=torch.long), torch.zeros(1, 3, 2, dtype=torch.long), torch.ones(1, 3, 2))
    trace.save(str(tmp_path / "t.pt"))
    with pytest.raises(ValueError, match="3 layers, 8 experts, top 2"):
        runner(RoutingOptions(f"replay:{tmp_path / 't.pt'}"))


def test_record_keeps_its_capacity(tmp_path):
    r = runner(RoutingOptions("synthetic", record=str(tmp_path / "t.pt"), record_tokens=10))
    generate(r, list(range(1, 9)), SamplingParams(), 6)
    r.save_routing_record()
    assert RoutingTrace.load(str(tmp_path / "t.pt")).step.numel() == 10


# ==== GPU ====

@pytest.mark.cuda
def test_recorded_synthetic_decode_steps_replay_graphs_without_sync(tmp_path):
    from worker.batch import SequenceChunk

    r = ModelRunner(RunnerConfig("small-geometry", device="cuda", dtype="bfloat16", kv_tokens=1024,
                                 experts=ExpertOptions(cache_fraction=0.25, dummy_weights=True),
                                 routing=RoutingOptions("synthetic", record=str(tmp_path / "t.pt"))))
    prompt, params = list(range(1, 30)), [SamplingParams()]
    pages = r.kv_pool.allocate(r.kv_pool.pages_for(len(prompt) + 8))
    token = int(r.forward([SequenceChunk(prompt, 0, pages)], params, [0]).next_tokens[0])
    r.graphs.capture_all()
    for step in range(1, 8):
        chunk = SequenceChunk([token], len(prompt) + step - 1, pages)
        torch.cuda.set_sync_debug_mode("error")
        try:
            out = r.forward([chunk], params, [step])
        finally:
            torch.cuda.set_sync_debug_mode("default")
        token = int(out.next_tokens[0])
    r.save_routing_record()
    trace = RoutingTrace.load(str(tmp_path / "t.pt"))
    assert trace.ids.shape[0] == len(prompt) + 7 and int(trace.step.unique().numel()) == 8


@pytest.mark.cuda
def test_synthetic_decode_in_cuda_graphs_equals_eager(tmp_path):
    def run(graphs: bool):
        r = ModelRunner(RunnerConfig("small-geometry", device="cuda", dtype="bfloat16", kv_tokens=1024,
                                     cuda_graph=graphs, experts=ExpertOptions(cache_fraction=0.25, dummy_weights=True),
                                     routing=RoutingOptions("synthetic", record=str(tmp_path / f"{graphs}.pt"))))
        tokens = generate(r, prompt, SamplingParams(), 16).token_ids
        r.save_routing_record()
        return tokens, RoutingTrace.load(str(tmp_path / f"{graphs}.pt")), r.model_config

    prompt = list(range(1, 30))
    eager, graphed = run(False), run(True)
    assert eager[0] == graphed[0] and torch.equal(eager[1].ids, graphed[1].ids)
    trace, cfg = graphed[1], graphed[2]
    assert trace.ids.shape[0] == len(prompt) + 15  # the graphs' warm-up rows (scratch page) are dropped
    router = SyntheticRouter(cfg.num_layers, cfg.num_experts, cfg.top_k, "cpu")
    keys = TokenKeys(trace.sequence, trace.position, torch.tensor(prompt + graphed[0][:15]))
    assert torch.equal(router.route(slice(None), keys)[1].transpose(0, 1), trace.ids)


def test_a_cleared_record_keeps_only_later_steps(tmp_path):
    r = runner(RoutingOptions("synthetic", record=str(tmp_path / "t.pt")))
    generate(r, list(range(1, 9)), SamplingParams(), 3)  # like the scheduler's warm-up
    r.clear_routing_record()
    generate(r, list(range(1, 6)), SamplingParams(), 2)
    r.save_routing_record()
    trace = RoutingTrace.load(str(tmp_path / "t.pt"))
    assert trace.position.tolist() == [0, 1, 2, 3, 4, 5]
