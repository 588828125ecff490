"""The fused decode-step glue kernels against their eager twins: residual add + RMSNorm, Qwen3's
q/k norm + RoPE, and the router's softmax + top-k. Interpreted on the CPU (TRITON_INTERPRET=1),
compiled and sync-free on a GPU."""
from __future__ import annotations

import contextlib
import importlib.util
import os
from typing import NamedTuple

import pytest
import torch

from moe_offload.kernels.topk_softmax import topk_softmax, topk_softmax_eager
from worker.models.norm import add_rms_norm, add_rms_norm_eager, rms_norm, rms_norm_eager
from worker.models.rotary import KVWrite, Rotary, qk_rope, qk_rope_eager

interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" or importlib.util.find_spec("triton") is None,
                                 reason="needs triton and TRITON_INTERPRET=1")
TRIALS = 20


class Shape(NamedTuple):
    tokens: int
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    experts: int
    top_k: int


CONFIGS = [Shape(1, 4, 2, 16, 64, 16, 4), Shape(5, 8, 2, 32, 96, 8, 2), Shape(13, 4, 4, 64, 40, 128, 8)]


@contextlib.contextmanager
def strict(device: str):
    """On a GPU the ops under test must not synchronise; building inputs and comparing may."""
    if device == "cuda":
        torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        if device == "cuda":
            torch.cuda.set_sync_debug_mode("default")


def _tol(dtype: torch.dtype) -> dict:
    if dtype == torch.float32:
        return dict(atol=1e-5, rtol=1e-5)
    # the interpreter truncates to bf16 where the GPU rounds: a chain of casts drifts a few ulps
    loose = not torch.cuda.is_available()
    return dict(atol=8e-2, rtol=4e-2) if loose else dict(atol=2e-2, rtol=2e-2)


def _norm_trial(shape: Shape, dtype: torch.dtype, device: str, gen: torch.Generator) -> None:
    x = (torch.randn(shape.tokens, shape.hidden, generator=gen) * 3).to(device, dtype)
    r = torch.randn(shape.tokens, shape.hidden, generator=gen).to(device, dtype)
    w = (torch.rand(shape.hidden, generator=gen) + 0.5).to(device, dtype)
    with strict(device):
        h, s = add_rms_norm(x, r, w, 1e-6, backend="triton")
        normed = rms_norm(x, w, 1e-6, backend="triton")
    h_ref, s_ref = add_rms_norm_eager(x, r, w, 1e-6)
    if device == "cuda" or dtype == torch.float32:  # the interpreter truncates to bf16 instead of rounding
        assert torch.equal(s, s_ref)  # the residual sum rounds once, exactly as the twin's
    torch.testing.assert_close(s, s_ref, **_tol(dtype))
    torch.testing.assert_close(h, h_ref, **_tol(dtype))
    torch.testing.assert_close(normed, rms_norm_eager(x, w, 1e-6), **_tol(dtype))


def _kv_write(v: torch.Tensor, slots: int, gen: torch.Generator) -> KVWrite:
    """Random caches of ``slots`` token slots and distinct slots for v's tokens (the last slot
    among them when there is room: the edge of the buffer)."""
    T, KV, D = v.shape
    caches = torch.randn(2, slots, KV, D, generator=gen).to(v.device, v.dtype)
    loc = torch.randperm(slots - 1, generator=gen)[:T - 1].tolist() + [slots - 1]
    return KVWrite(v, caches[0], caches[1], torch.tensor(loc, device=v.device))


def _rope_trial(shape: Shape, dtype: torch.dtype, device: str, gen: torch.Generator, norm: bool,
                write: bool) -> None:
    T, H, KV, D = shape.tokens, shape.heads, shape.kv_heads, shape.head_dim
    rotary = Rotary(D, 10000.0, 64, torch.device(device))
    qkv = torch.randn(T, (H + 2 * KV) * D, generator=gen).to(device, dtype)
    q, k, v = qkv.split([H * D, KV * D, KV * D], dim=-1)  # strided views, as the model passes them
    q, k, v = q.view(T, H, D), k.view(T, KV, D), v.view(T, KV, D)
    positions = torch.randint(0, 64, (T,), generator=gen).to(device)
    norms = ((torch.rand(D, generator=gen) + 0.5).to(device, dtype), (torch.rand(D, generator=gen) + 0.5).to(device, dtype)) if norm else (None, None)
    kv = _kv_write(v, T + 3, gen) if write else None
    kv_ref = kv._replace(k_cache=kv.k_cache.clone(), v_cache=kv.v_cache.clone()) if write else None
    with strict(device):
        got = qk_rope(q, k, positions, rotary, *norms, 1e-6, write=kv, backend="triton")
    ref = qk_rope_eager(q, k, positions, rotary, *norms, 1e-6, kv_ref)
    for a, b in zip(got, ref):
        assert a.is_contiguous()
        torch.testing.assert_close(a, b, **_tol(dtype))
    if write:
        assert torch.equal(kv.v_cache, kv_ref.v_cache)  # values are copied bit for bit
        torch.testing.assert_close(kv.k_cache, kv_ref.k_cache, **_tol(dtype))
        assert torch.equal(kv.k_cache[kv.out_loc], got[1])  # the cache holds exactly the returned keys


def _route_trial(shape: Shape, dtype: torch.dtype, device: str, gen: torch.Generator, renorm: bool) -> None:
    logits = torch.randn(shape.tokens, shape.experts, generator=gen).to(device, dtype)
    with strict(device):
        w, ids = topk_softmax(logits, shape.top_k, renorm)
    w_ref, ids_ref = topk_softmax_eager(logits, shape.top_k, renorm)
    torch.testing.assert_close(w, w_ref, atol=1e-6, rtol=1e-5)
    # bf16 logits tie often (also at the k-th place), and a tie may go either way: the kernel's ids
    # must be k distinct experts whose probabilities are the top k, in order
    probs = torch.softmax(logits.float(), dim=-1)
    torch.testing.assert_close(probs.gather(1, ids), torch.topk(probs, shape.top_k).values, atol=1e-6, rtol=1e-5)
    assert all(len(set(row)) == shape.top_k for row in ids.tolist())
    if dtype == torch.float32:  # no ties: the very same ids
        assert torch.equal(ids, ids_ref)


def _run_all(device: str, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    for shape in CONFIGS:
        for trial in range(TRIALS):
            _norm_trial(shape, dtype, device, gen)
            _rope_trial(shape, dtype, device, gen, norm=trial % 2 == 0, write=trial % 4 < 2)
            _route_trial(shape, dtype, device, gen, renorm=trial % 3 != 0)


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_glue_interpreted_matches_twins(dtype):
    _run_all("cpu", dtype)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_glue_cuda_matches_twins_without_syncs(dtype):
    _run_all("cuda", dtype)


@pytest.mark.skipif(not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                    reason="needs a GPU or TRITON_INTERPRET=1")
def test_route_ties_take_the_lower_id_first():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    weights, ids = topk_softmax(torch.tensor([[0.0, 2.0, 2.0, 1.0, 2.0]], device=device), 3, True)
    assert ids.tolist() == [[1, 2, 4]]
    torch.testing.assert_close(weights.cpu(), torch.full((1, 3), 1 / 3))


@pytest.mark.skipif(not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                    reason="needs a GPU or TRITON_INTERPRET=1")
def test_rope_write_clamps_slots_to_the_cache():
    """Slots are device data: one past the cache lands in its last slot, never outside it."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    q, k, v = torch.randn(3, 2, 8, device=device), torch.randn(3, 1, 8, device=device), torch.randn(3, 1, 8, device=device)
    write = KVWrite(v, torch.zeros(5, 1, 8, device=device), torch.zeros(5, 1, 8, device=device),
                    torch.tensor([-4, 9, 2], device=device))
    _, k_out = qk_rope(q, k, torch.zeros(3, dtype=torch.int64, device=device), Rotary(8, 1e4, 4, torch.device(device)),
                       write=write, backend="triton")
    assert torch.equal(write.k_cache[[0, 4, 2]], k_out) and torch.equal(write.v_cache[[0, 4, 2]], v)
    assert not write.k_cache[[1, 3]].any() and not write.v_cache[[1, 3]].any()


@pytest.mark.parametrize("bad", ["weight", "residual", "positions", "norms", "top_k", "cache"])
def test_bad_shapes_are_refused_on_the_host(bad):
    x = torch.randn(3, 8)
    with pytest.raises(ValueError):
        if bad == "weight":
            rms_norm(x, torch.ones(7), 1e-6)
        elif bad == "residual":
            add_rms_norm(x, torch.randn(3, 9), torch.ones(8), 1e-6)
        elif bad == "positions":
            qk_rope(torch.randn(3, 2, 8), torch.randn(3, 1, 8), torch.zeros(4, dtype=torch.int64), Rotary(8, 1e4, 16, torch.device("cpu")))
        elif bad == "norms":
            qk_rope(torch.randn(3, 2, 8), torch.randn(3, 1, 8), torch.zeros(3, dtype=torch.int64), Rotary(8, 1e4, 16, torch.device("cpu")), torch.ones(8), None)
        elif bad == "cache":
            k = torch.randn(3, 1, 8)
            write = KVWrite(k, torch.zeros(6, 2, 8), torch.zeros(6, 2, 8), torch.zeros(3, dtype=torch.int64))
            qk_rope(torch.randn(3, 2, 8), k, torch.zeros(3, dtype=torch.int64), Rotary(8, 1e4, 16, torch.device("cpu")), write=write)
        else:
            topk_softmax(x, 9, True)
