"""Cross-layer expert prefetch (``--expert-prefetch``): the same tokens with it on and off, a guess
of the next layer raises that layer's hit rate, a wrong guess costs bytes only, the ahead lookup
never takes a slot the layer before reads; the synthetic stand-in guesses at its stated accuracy.
CPU with the eager twins; on a GPU the offloaded layers and a CUDA-graph decode under
``set_sync_debug_mode("error")``."""
from __future__ import annotations

import contextlib

import pytest
import torch

from moe_offload import offloaded as offloaded_mod
from moe_offload.choices import FILL_MODES
from moe_offload.experts import ExpertBanks, ResidentExperts
from moe_offload.kernels import lookup_admit as lookup_mod
from moe_offload.kernels.lookup_admit import Policy
from moe_offload.offloaded import OffloadedExperts
from moe_offload.prefill_pipeline import HostStreams
from moe_offload.synthetic_routing import GUESS_ACCURACY, SyntheticRouter, TokenKeys
from tests.test_cache_kernels import Config, empty_tables
from tests.test_expert_cache import make_banks
from tests.tiny_models import write_tiny
from worker.expert_placement import ExpertOptions
from scheduler.generate import generate
from worker.routing_options import RoutingOptions
from worker.runner import ModelRunner, RunnerConfig
from scheduler.messages.to_scheduler import SamplingParams

LAYERS, EXPERTS, TOP_K = 4, 16, 4


def fresh_routing(gen: torch.Generator, tokens: int, device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Uniform routing, distinct ids per token (a cache of half the experts rarely holds them), and
    a wrong guess of it: experts no token chose."""
    ids = torch.stack([torch.randperm(EXPERTS, generator=gen)[:TOP_K] for _ in range(tokens)])
    weights = torch.rand(tokens, TOP_K, generator=gen)
    unused = torch.ones(EXPERTS, dtype=torch.bool)
    unused[ids.flatten()] = False
    wrong = torch.nonzero(unused).flatten()[:TOP_K].expand(tokens, TOP_K)
    return (weights / weights.sum(1, keepdim=True)).to(device), ids.to(device), wrong.to(device)


def run_steps(offloaded: OffloadedExperts, resident: ResidentExperts, guess: str, device: str = "cpu",
              guard=contextlib.nullcontext, steps: int = 4, tokens: int = 1, hidden: int = 16) -> None:
    """Decode steps through every layer with ``guess`` ("exact", "wrong" or "none") for the next
    layer; each layer's output must equal the resident experts'."""
    gen = torch.Generator().manual_seed(1)
    dtype = offloaded.cache.w13.dtype
    for _ in range(steps):
        routing = [fresh_routing(gen, tokens, device) for _ in range(LAYERS)]
        xs = [torch.randn(tokens, hidden, generator=gen).to(device, dtype) for _ in range(LAYERS)]
        with guard():
            outs = [offloaded.forward(layer, xs[layer], *routing[layer][:2], next_ids=_guess(guess, routing, layer))
                    for layer in range(LAYERS)]
        for layer, out in enumerate(outs):
            torch.testing.assert_close(out.float(), resident.forward(layer, xs[layer], *routing[layer][:2]).float(),
                                       rtol=2e-2, atol=2e-2)


def _guess(kind: str, routing: list, layer: int) -> torch.Tensor | None:
    if kind == "none" or layer + 1 == LAYERS:
        return None
    return routing[layer + 1][1 if kind == "exact" else 2]


def offloaded_pair(banks: ExpertBanks, device: str = "cpu") -> dict[str, OffloadedExperts]:
    return {name: OffloadedExperts.create(banks, 2 * EXPERTS, device, "lfru", prefetch=name != "off")
            for name in ("off", "exact", "wrong")}


def layer_stats(offloaded: OffloadedExperts) -> list[dict]:
    return offloaded.cache.stats()["layers"]


def test_guess_raises_the_next_layers_hit_rate_and_a_wrong_one_costs_bytes_only():
    banks = make_banks(LAYERS, EXPERTS, 16, 8)
    resident = ResidentExperts(banks)
    runs = offloaded_pair(banks)
    for name, offloaded in runs.items():
        run_steps(offloaded, resident, "none" if name == "off" else name)
    exact, off, wrong = (layer_stats(runs[n]) for n in ("exact", "off", "wrong"))
    for layer in range(1, LAYERS):  # layer 0 has no layer before it to guess from
        assert exact[layer]["hits"] == exact[layer]["lookups"] == exact[layer]["predicted"], exact[layer]
        assert off[layer]["hits"] < off[layer]["lookups"], off[layer]
        assert wrong[layer]["predicted"] == 0
    assert runs["off"].cache.stats()["prefetch"]["lookups"] == 0
    spent = runs["wrong"].cache.stats()["prefetch"]
    assert spent["misses"] > 0 and spent["bytes_h2d"] == spent["misses"] * runs["wrong"].cache.slot_bytes


def test_a_capped_guess_copies_at_most_its_cap_a_layer_and_changes_no_result():
    """``prefetch_cap=1``: each guess admits one expert at most (the next layer then misses the rest
    of what the guess had), and every output still equals the resident experts'."""
    banks = make_banks(LAYERS, EXPERTS, 16, 8)
    resident = ResidentExperts(banks)
    runs = {cap: OffloadedExperts.create(banks, 2 * EXPERTS, "cpu", "lfru", prefetch=True, prefetch_cap=cap)
            for cap in (0, 1)}
    for offloaded in runs.values():
        run_steps(offloaded, resident, "exact")
    guesses = 4 * (LAYERS - 1)  # run_steps' steps, a guess for every layer but the first
    capped, uncapped = (runs[cap].cache.stats()["prefetch"] for cap in (1, 0))
    assert 0 < capped["misses"] <= guesses < uncapped["misses"]
    assert capped["bytes_h2d"] == capped["misses"] * runs[1].cache.slot_bytes
    later = [layer_stats(runs[1])[layer] for layer in range(1, LAYERS)]
    assert any(s["misses"] > 0 for s in later) and all(s["predicted"] > 0 for s in later)


def test_a_guess_is_taken_only_where_the_next_lookup_keeps_its_victims():
    """8 decode slots: a guess of 4 pairs beside 4 real ones fits, of 8 beside 8 does not (it
    could leave the real lookup no victim), and is then ignored; pipelined batches take none."""
    banks = make_banks(LAYERS, EXPERTS, 16, 8)
    small = OffloadedExperts.create(banks, 8, "cpu", prefetch=True)
    assert small.fetches_ahead(1, TOP_K) and not small.fetches_ahead(2, TOP_K)
    x, (weights, ids, _) = torch.randn(2, 16), fresh_routing(torch.Generator().manual_seed(0), 2, "cpu")
    torch.testing.assert_close(small.forward(0, x, weights, ids, next_ids=ids),
                               ResidentExperts(banks).forward(0, x, weights, ids))
    assert small.cache.stats()["prefetch"]["lookups"] == 0
    piped = OffloadedExperts.create(banks, 3 * EXPERTS, "cpu", pipeline=True, prefetch=True)
    assert piped.fetches_ahead(1, TOP_K) and not piped.fetches_ahead(EXPERTS, TOP_K)  # 4E pairs: pipelined
    assert not OffloadedExperts.create(banks, 8, "cpu").fetches_ahead(1, TOP_K)


def test_each_guess_is_forked_after_its_plan_and_joined_before_the_next():
    """The stream log of one decode step: a guess's gather waits for its plan on the copy stream,
    the compute stream waits for it at the next layer before anything else is forked, and the step
    ends joined (what a captured graph needs)."""
    banks = make_banks(LAYERS, EXPERTS, 16, 8)
    offloaded = OffloadedExperts.create(banks, 2 * EXPERTS, "cpu", prefetch=True)
    log: list[tuple[str, ...]] = []
    offloaded.prefetch.streams = HostStreams(log)
    run_steps(offloaded, ResidentExperts(banks), "exact", steps=1)
    fork = [("record", "planned", "compute"), ("wait", "copy", "planned")]
    want = fork + [("copy", "prefetch layer 1"), ("record", "fetched", "copy")]
    for layer in range(2, LAYERS):
        want += [("wait", "compute", "fetched")] + fork + [("copy", f"prefetch layer {layer}"),
                                                           ("record", "fetched", "copy")]
    assert log == want + [("wait", "compute", "fetched")]


@pytest.mark.parametrize("fill", FILL_MODES)
def test_guess_is_forked_beside_a_gathers_gemm_and_after_a_filling_one(monkeypatch, fill):
    """With ``fill="gather"`` the guess's gather runs beside the layer's GEMM; with ``"gemm"`` the
    GEMM reads the layer's misses over PCIe itself, so the guess is admitted and forked after it."""
    banks = make_banks(LAYERS, EXPERTS, 16, 8)
    offloaded = OffloadedExperts.create(banks, 2 * EXPERTS, "cpu", prefetch=True, fill=fill)
    log: list[tuple[str, ...]] = []
    offloaded.prefetch.streams = HostStreams(log)
    gemm = offloaded_mod.grouped_swiglu
    monkeypatch.setattr(offloaded_mod, "grouped_swiglu", lambda *a, **k: log.append(("gemm",)) or gemm(*a, **k))
    run_steps(offloaded, ResidentExperts(banks), "exact", steps=1)
    fork, gemm_call = ("record", "planned", "compute"), ("gemm",)
    layer = [gemm_call, fork] if fill == "gemm" else [fork, gemm_call]
    assert [e for e in log if e in (fork, gemm_call)] == layer * (LAYERS - 1) + [gemm_call]


def test_ahead_lookup_spares_the_layer_before_and_drops_what_does_not_fit():
    """Step 10: slots 0-1 hold layer 0's experts used by the launch before (step 9), slot 2 an old
    one, slot 3 is empty. A guess of four misses of layer 1 takes slots 3 and 2 only, with score 0,
    marks them for step 10 and leaves the step; the real lookup at step 10 counts them predicted."""
    cfg = Config(2, 8, 4, 0, 4, 1, 4, Policy(4, 8))
    tables = empty_tables(cfg)
    for slot, (gid, last) in enumerate([(0, 9), (1, 9), (2, 3)]):
        tables.id_of_slot[slot], tables.slot_for_id[gid] = gid, slot
        tables.last_use[slot], tables.score[slot] = last, last
    tables.step.fill_(10)
    ahead = tables._replace(stats=torch.zeros_like(tables.stats))  # counted apart, as ExpertCache does
    plan, _ = lookup_mod.lookup_admit(torch.tensor([[4, 5, 6, 7]]), 1, 8, ahead, 0, 4, cfg.policy, 1,
                                      backend="eager", ahead=True)
    assert plan.count.tolist() == [2] and plan.src_id.tolist()[:2] == [12, 13] and plan.dst_slot.tolist()[:2] == [3, 2]
    assert tables.step.tolist() == [10] and tables.score[2:].tolist() == [0, 0] and tables.last_use.tolist() == [9, 9, 10, 10]
    lookup_mod.lookup_admit(torch.tensor([[4, 5]]), 1, 8, tables, 0, 4, cfg.policy, 1, backend="eager")
    assert ahead.stats[1].tolist() == [4, 0, 2, 1, 2, 0]  # 4 guessed, 2 admitted, expert 2 evicted, 2 bytes
    assert tables.stats[1].tolist() == [2, 2, 0, 0, 0, 2]  # both hits were the guess's
    assert tables.score[2:].tolist() == [10 + 4, 10 + 4]  # credited once, by the real lookup


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-prefetch")
    write_tiny(path, "qwen3_moe", seed=5, layers=4, experts=8, top_k=2)
    return str(path)


def cpu_runner(model_dir: str, fraction: float, prefetch: bool) -> ModelRunner:
    return ModelRunner(RunnerConfig(model_dir, device="cpu", dtype="float32", page_size=4, kv_tokens=512,
                                    experts=ExpertOptions(cache_fraction=fraction, prefetch=prefetch)))


@pytest.mark.parametrize("fraction", [0.5, 0.75], ids=["no-pipeline", "pipeline"])
def test_prefetch_on_and_off_generate_the_same_tokens(model_dir, fraction):
    """The model's router guesses from the layer before (a real predictor on a real forward pass);
    at 75% the prefill pipeline runs the prompts and decode prefetches beside it."""
    off, on = cpu_runner(model_dir, fraction, False), cpu_runner(model_dir, fraction, True)
    assert (on.experts.pipeline is not None) == (fraction == 0.75)
    for prompt in ([5, 9, 11, 3], list(range(1, 40))):
        want = generate(off, prompt, SamplingParams(), 12).token_ids
        assert generate(on, prompt, SamplingParams(), 12).token_ids == want
    stats = on.experts.cache.stats()
    assert stats["prefetch"]["lookups"] > 0 and stats["total"]["predicted"] > 0
    assert off.experts.cache.stats()["prefetch"]["lookups"] == 0


def test_synthetic_routing_prefetch_same_tokens_and_guesses_right():
    """Dummy weights under ``--routing synthetic`` (what bench_decode measures): the stand-in
    predictor, all layers' guesses at once, leaves the tokens as they are."""
    runs = [ModelRunner(RunnerConfig("tiny-geometry", device="cpu", dtype="float32", page_size=4, kv_tokens=256,
                                     routing=RoutingOptions("synthetic"),
                                     experts=ExpertOptions(cache_fraction=0.5, dummy_weights=True, prefetch=on)))
            for on in (False, True)]
    tokens = [generate(r, [1, 2, 3, 4, 5], SamplingParams(), 8).token_ids for r in runs]
    assert tokens[0] == tokens[1]
    assert runs[1].experts.cache.stats()["total"]["predicted"] > 0


def test_synthetic_guess_keeps_its_stated_share():
    router = SyntheticRouter(3, 64, 8, "cpu", seed=2)
    tokens = 2000
    keys = TokenKeys(torch.arange(tokens) % 7 + 1, torch.arange(tokens), torch.arange(tokens) * 31 % 1000)
    _, ids = router.route(slice(None), keys)
    guesses = router.guess(slice(None), keys, ids)
    for layer in range(3):
        kept = (guesses[layer] == ids[layer]).float().mean().item()  # a draw may also land on the true choice
        assert GUESS_ACCURACY <= kept <= GUESS_ACCURACY + 0.04, (layer, kept)
        one = router.guess(slice(layer, layer + 1), keys, ids[layer:layer + 1])[0]
        assert torch.equal(guesses[layer], one)  # a pure function of the layer and the keys


# ==== GPU ====

@pytest.mark.cuda
def test_cuda_prefetch_layers_match_resident_without_sync():
    from tests.test_prefill_pipeline import sync_errors

    banks = make_banks(LAYERS, EXPERTS, 64, 32)
    banks = ExpertBanks(banks.w13.bfloat16(), banks.w2.bfloat16())
    host = ExpertBanks(banks.w13.pin_memory(), banks.w2.pin_memory())
    resident = ResidentExperts(ExpertBanks(banks.w13.cuda(), banks.w2.cuda()))
    runs = offloaded_pair(host, "cuda")
    for name, offloaded in runs.items():
        kind = "none" if name == "off" else name
        run_steps(offloaded, resident, kind, "cuda", steps=1, tokens=3, hidden=64)  # compiles the kernels
        run_steps(offloaded, resident, kind, "cuda", sync_errors, tokens=3, hidden=64)
    torch.cuda.synchronize()
    exact = layer_stats(runs["exact"])
    assert all(exact[layer]["hits"] == exact[layer]["lookups"] for layer in range(1, LAYERS)), exact


@pytest.mark.cuda
@pytest.mark.parametrize("fraction", [0.5, 0.8], ids=["no-pipeline", "pipeline"])
def test_cuda_graph_decode_with_prefetch_matches_eager_without_prefetch(tmp_path, fraction):
    """Graph replays (prefetch captured: fork to the copy stream and join) give the logits and
    greedy tokens of an eager runner without prefetch, under sync debug mode "error"."""
    from tests.test_decode_graph import decode_in_lockstep, gpu_runner

    write_tiny(tmp_path, "mixtral", seed=6, layers=4, experts=8, top_k=2)
    eager = gpu_runner(str(tmp_path), "float32", False, cache_fraction=fraction)
    graphed = gpu_runner(str(tmp_path), "float32", True, cache_fraction=fraction, prefetch=True)
    decode_in_lockstep(graphed, eager, (1, 6), 1e-4, steps=3)
    stats = graphed.experts.cache.stats()
    assert stats["prefetch"]["lookups"] > 0 and stats["total"]["predicted"] > 0


@pytest.mark.cuda
def test_cuda_graph_decode_synthetic_routing_with_prefetch():
    """The benchmark's path (dummy weights, ``--routing synthetic``, 25% cache with the prefill
    pipeline): the stand-in guesses are made inside the captured graph; same logits and greedy
    tokens as eager decode without prefetch, replays under sync debug mode "error"."""
    from tests.test_decode_graph import decode_in_lockstep

    def runner(graph: bool, prefetch: bool) -> ModelRunner:
        return ModelRunner(RunnerConfig("small-geometry", device="cuda", dtype="bfloat16", page_size=16,
                                        kv_tokens=8192, cuda_graph=graph, routing=RoutingOptions("synthetic"),
                                        experts=ExpertOptions(cache_fraction=0.25, dummy_weights=True,
                                                              prefetch=prefetch)))

    graphed, eager = runner(True, True), runner(False, False)
    assert graphed.experts.pipeline is not None
    decode_in_lockstep(graphed, eager, (1, 8), 2e-2, steps=3)
    stats = graphed.experts.cache.stats()
    assert stats["prefetch"]["lookups"] > 0 and stats["total"]["predicted"] > 0
