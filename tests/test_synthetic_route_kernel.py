"""The synthetic router in one launch (moe_offload/kernels/synthetic_route.py) against its eager twin
(``SyntheticRouter.route_eager``, ``guess_eager``), ids and weights bit for bit: interpreted on the
CPU, and compiled on a GPU, sync-free and replayed from a CUDA graph."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from moe_offload.synthetic_routing import SyntheticRouter, TokenKeys  # noqa: E402
from tests.launch_count import count_launches  # noqa: E402

interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")

CONFIGS = [(3, 32, 4), (4, 128, 8), (2, 256, 16)]  # (layers, experts, top_k)
TRIALS = 20
# int64 edges: 32-bit wraps, negatives (the epoch's floor division), the extremes (no overflow on the
# twin's position + phase)
EDGES = [0, 1, 7, 8, -1, -8, -9, (1 << 31) - 1, 1 << 31, (1 << 32) - 1, 1 << 32, (1 << 63) - 8, -(1 << 63)]


def random_keys(tokens: int, seed: int) -> TokenKeys:
    """Even seeds: keys as serving makes them (small sequence keys, consecutive positions, token ids);
    odd seeds: any int64, wider than 32 bits and negative ones, with the edges mixed in."""
    gen = torch.Generator().manual_seed(seed)
    if seed % 2 == 0:
        start = int(torch.randint(0, 5000, (1,), generator=gen))
        return TokenKeys(torch.randint(1, 9, (tokens,), generator=gen), torch.arange(start, start + tokens),
                         torch.randint(0, 150_000, (tokens,), generator=gen))
    parts = []
    for _ in range(3):
        x = torch.randint(-(1 << 62), 1 << 62, (tokens,), generator=gen)
        pick = torch.randint(0, len(EDGES) * 2, (tokens,), generator=gen)
        parts.append(torch.where(pick < len(EDGES), torch.tensor(EDGES)[pick.clamp(max=len(EDGES) - 1)], x))
    return TokenKeys(*parts)


def to(keys: TokenKeys, device: str) -> TokenKeys:
    return TokenKeys(*(k.to(device) for k in keys))


def kernels(router: SyntheticRouter, layers: slice, keys: TokenKeys) -> tuple[torch.Tensor, ...]:
    """The kernels' weights, ids and guesses, on the CPU; on a GPU a host sync among them fails."""
    on_gpu = keys.sequence.is_cuda
    if on_gpu:
        torch.cuda.set_sync_debug_mode("error")
    try:
        weights, ids = router.route(layers, keys, backend="triton")
        guesses = router.guess(layers, keys, ids, backend="triton")
    finally:
        if on_gpu:
            torch.cuda.set_sync_debug_mode("default")
    return weights.cpu(), ids.cpu(), guesses.cpu()


def check(router: SyntheticRouter, twin: SyntheticRouter, layers: slice, keys: TokenKeys) -> None:
    """The kernels' route and guess of ``layers`` equal the twins' (``twin`` lives on the CPU)."""
    weights, ids, guesses = kernels(router, layers, keys)
    keys = to(keys, "cpu")
    want_w, want_ids = twin.route_eager(layers, keys)
    assert torch.equal(ids, want_ids)
    assert torch.equal(weights, want_w)  # exact float32 sums, IEEE division on both sides
    assert torch.equal(guesses, twin.guess_eager(layers, keys, want_ids))


def trials(device: str, config: tuple[int, int, int]) -> None:
    layers, experts, top_k = config
    for trial in range(TRIALS):
        router = SyntheticRouter(layers, experts, top_k, device, seed=trial)
        twin = router if device == "cpu" else SyntheticRouter(layers, experts, top_k, "cpu", seed=trial)
        keys = to(random_keys(1 + trial % 9, seed=trial), device)
        check(router, twin, slice(None), keys)
        layer = trial % layers
        check(router, twin, slice(layer, layer + 1), keys)


@interpreted
@pytest.mark.parametrize("config", CONFIGS)
def test_kernels_match_twin_interpreted(config):
    trials("cpu", config)


@interpreted
@pytest.mark.parametrize("experts, top_k, tokens", [(8, 8, 70), (128, 8, 100), (1024, 16, 5)])
def test_many_tokens_few_experts_and_the_widest_layer_interpreted(experts, top_k, tokens):
    """Several programs along the tokens (a partial last block), more lanes than experts, 1024 experts;
    every other layer (a slice with a step)."""
    router = SyntheticRouter(3, experts, top_k, "cpu", seed=11)
    check(router, router, slice(None, None, 2), random_keys(tokens, seed=3))
    check(router, router, slice(2, 3), random_keys(tokens, seed=4))


@interpreted
def test_route_and_guess_are_one_launch_each():
    router = SyntheticRouter(4, 128, 8, "cpu")
    keys = random_keys(3, seed=0)
    with count_launches() as routed:
        _, ids = router.route(slice(None), keys, backend="triton")
    with count_launches() as guessed:
        router.guess(slice(None), keys, ids, backend="triton")
    assert routed.launches == {"triton._route_kernel": 1} and guessed.launches == {"triton._guess_kernel": 1}


def test_cpu_keys_take_the_twin():
    router = SyntheticRouter(2, 16, 4, "cpu")
    keys = random_keys(5, seed=1)
    with count_launches() as counted:
        _, ids = router.route(slice(None), keys)
    assert torch.equal(ids, router.route_eager(slice(None), keys)[1]) and "triton._route_kernel" not in counted.launches


@interpreted
def test_empty_batches_launch_nothing():
    router = SyntheticRouter(2, 16, 4, "cpu")
    keys = random_keys(5, seed=1)
    empty = TokenKeys(*(k[:0] for k in keys))
    with count_launches() as counted:
        weights, ids = router.route(slice(None), empty, backend="triton")
        no_layers = router.route(slice(0, 0), keys, backend="triton")[1]
        guesses = router.guess(slice(None), empty, ids, backend="triton")
    assert weights.shape == ids.shape == guesses.shape == (2, 0, 4) and no_layers.shape == (0, 5, 4)
    assert counted.total == 0


# ==== GPU ====

@pytest.mark.cuda
@pytest.mark.parametrize("config", CONFIGS)
def test_kernels_match_twin_on_gpu_without_syncs(config):
    trials("cuda", config)  # the kernels' launches run under set_sync_debug_mode("error") (``kernels``)


@pytest.mark.cuda
def test_kernels_match_the_cuda_twin_on_many_tokens():
    router = SyntheticRouter(48, 128, 8, "cuda", seed=1)
    keys = to(random_keys(4096, seed=5), "cuda")
    weights, ids = router.route(slice(None), keys)  # CUDA keys take the kernel by default
    want_w, want_ids = router.route_eager(slice(None), keys)
    assert torch.equal(ids, want_ids) and torch.equal(weights, want_w)
    assert torch.equal(router.guess(slice(None), keys, ids), router.guess_eager(slice(None), keys, ids))
    one = router.route(slice(7, 8), keys)
    assert torch.equal(one[1][0], ids[7]) and torch.equal(one[0][0], weights[7])


@pytest.mark.cuda
def test_route_and_guess_replay_from_a_cuda_graph(capture_graph):
    router = SyntheticRouter(48, 128, 8, "cuda", seed=2)
    twin = SyntheticRouter(48, 128, 8, "cpu", seed=2)
    static = to(random_keys(4, seed=0), "cuda")

    def route_and_guess():  # a host read inside would fail the capture
        weights, ids = router.route(slice(None), static)
        return weights, ids, router.guess(slice(None), static, ids)

    graph, (weights, ids, guesses) = capture_graph(route_and_guess)
    for step in range(1, 20):
        keys = random_keys(4, seed=step)
        torch.cuda.set_sync_debug_mode("error")
        try:
            for dst, src in zip(static, keys):
                dst.copy_(src.pin_memory(), non_blocking=True)
            graph.replay()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        want_w, want_ids = twin.route_eager(slice(None), keys)
        assert torch.equal(ids.cpu(), want_ids) and torch.equal(weights.cpu(), want_w)
        assert torch.equal(guesses.cpu(), twin.guess_eager(slice(None), keys, want_ids))
