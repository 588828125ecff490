"""The sampler's hashed Gumbel noise (worker/gumbel.py): the one-launch kernel against its eager
twin, interpreted on the CPU and compiled, sync-free, on a GPU."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from worker.gumbel import BLOCK, gumbel_noise, gumbel_noise_eager  # noqa: E402

TRIALS = 20
CONFIGS = [(1, 37), (3, BLOCK), (4, 2 * BLOCK + 5)]  # rows, vocab: under one block, exactly one, a ragged tail


def check(rows: int, vocab: int, device: str, gen: torch.Generator) -> None:
    seed = torch.randint(0, 1 << 32, (rows,), generator=gen)
    seed[0] = (1 << 32) - 1  # every bit of the 32 set: products must wrap where the twin masks
    step = torch.randint(0, 1 << 32, (rows,), generator=gen)
    token = torch.stack([torch.randperm(vocab, generator=gen) for _ in range(rows)])  # a sort's order
    seed, step, token = seed.to(device), step.to(device), token.to(device)
    if device == "cuda":
        torch.cuda.set_sync_debug_mode("error")
    try:
        noise = gumbel_noise(seed, step, token, backend="triton")
    finally:
        if device == "cuda":
            torch.cuda.set_sync_debug_mode("default")
    want = gumbel_noise_eager(seed[:, None], step[:, None], token)
    torch.testing.assert_close(noise, want, rtol=2e-6, atol=2e-6)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("shape", CONFIGS, ids=lambda c: "B{}V{}".format(*c))
def test_kernel_matches_twin_interpreted(shape):
    gen = torch.Generator().manual_seed(shape[1])
    for _ in range(TRIALS):
        check(*shape, "cpu", gen)


@pytest.mark.cuda
@pytest.mark.parametrize("shape", CONFIGS + [(8, 151936)], ids=lambda c: "B{}V{}".format(*c))
def test_kernel_matches_twin_on_gpu_without_syncs(shape):
    gen = torch.Generator().manual_seed(shape[1])
    check(*shape, "cuda", gen)  # compiles outside nothing: the kernel launch itself never syncs
    for _ in range(TRIALS):
        check(*shape, "cuda", gen)


def test_noise_depends_on_seed_step_and_token_only():
    token = torch.arange(50)[None].repeat(2, 1)
    noise = gumbel_noise(torch.tensor([7, 7]), torch.tensor([3, 3]), token)
    assert torch.equal(noise[0], noise[1])
    other = gumbel_noise(torch.tensor([7, 8]), torch.tensor([4, 3]), token)
    assert not torch.equal(other[0], noise[0]) and not torch.equal(other[1], noise[0])


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError):
        gumbel_noise(torch.zeros(2, dtype=torch.int64), torch.zeros(3, dtype=torch.int64), torch.zeros(2, 5, dtype=torch.int64))
