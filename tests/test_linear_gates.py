"""The Gated DeltaNet glue kernels (worker/linear_attention/gates.py) against their eager twins:
interpreted on the CPU, compiled in bf16 under the sync check on a GPU."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from worker.linear_attention.gates import (delta_gates, delta_gates_eager, gated_rms_norm,  # noqa: E402
                                           gated_rms_norm_eager)

interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")
# tokens, value heads, head dim: powers of two and not
SHAPES = [(1, 4, 16), (7, 6, 24), (3, 32, 128)]
TRIALS = 20


def projection(T: int, Hv: int, Dv: int, dtype: torch.dtype, device: str, gen: torch.Generator):
    """a, b and z as the layer takes them: column views of one projection row per token; a reaches
    past softplus's threshold of 20 both ways."""
    proj = torch.randn(T, 3 * Hv + Hv * Dv + 5, generator=gen)
    proj[:, :Hv] *= 15
    proj = proj.to(device, dtype)
    a, b = proj[:, :Hv], proj[:, Hv:2 * Hv]
    z = proj[:, 2 * Hv + 3:2 * Hv + 3 + Hv * Dv].reshape(T, Hv, Dv)
    return a, b, z


def cases(shape, dtype, device, trials):
    T, Hv, Dv = shape
    for trial in range(trials):
        gen = torch.Generator().manual_seed(trial)
        a, b, z = projection(T, Hv, Dv, dtype, device, gen)
        A_log, dt_bias = (torch.randn(Hv, generator=gen).to(device) for _ in range(2))
        x = (torch.randn(T, Hv, Dv, generator=gen) * 3).to(device, dtype)
        yield a, b, A_log, dt_bias, x, z, torch.randn(Dv, generator=gen).to(device, dtype)


def check(shape, dtype, device, backend, trials=TRIALS, sync_free=False):
    """The kernels over ``trials`` random inputs (under the sync check with ``sync_free``), then
    each against its twin."""
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    inputs = list(cases(shape, dtype, device, trials))
    if sync_free:
        torch.cuda.set_sync_debug_mode("error")
    try:
        outs = [(*delta_gates(a, b, A, dt, backend=backend), gated_rms_norm(x, z, w, 1e-6, backend=backend))
                for a, b, A, dt, x, z, w in inputs]
    finally:
        if sync_free:
            torch.cuda.set_sync_debug_mode("default")
    for trial, ((g, beta, out), (a, b, A, dt, x, z, w)) in enumerate(zip(outs, inputs)):
        g_ref, beta_ref = delta_gates_eager(a, b, A, dt)
        assert g.dtype == torch.float32 and beta.dtype == dtype
        assert torch.allclose(g, g_ref, rtol=1e-5, atol=1e-6), trial
        assert torch.allclose(beta.float(), beta_ref.float(), rtol=tol, atol=tol), trial
        ref = gated_rms_norm_eager(x, z, w, 1e-6)
        assert out.dtype == dtype and torch.allclose(out.float(), ref.float(), rtol=tol, atol=tol), trial


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_kernels_match_twins_interpreted(shape, dtype):
    check(shape, dtype, "cpu", "triton", trials=4)


def test_checks_on_the_host():
    a = torch.randn(2, 4)
    with pytest.raises(ValueError, match="do not match"):
        delta_gates(a, a[:, :3], torch.zeros(4), torch.zeros(4))
    with pytest.raises(ValueError, match="float32"):
        delta_gates(a, a, torch.zeros(4, dtype=torch.float16), torch.zeros(4))
    x = torch.randn(2, 4, 8)
    with pytest.raises(ValueError, match="do not match"):
        gated_rms_norm(x, x, torch.ones(4), 1e-6)
    with pytest.raises(ValueError, match="x's dtype"):
        gated_rms_norm(x, x, torch.ones(8, dtype=torch.float16), 1e-6)


@pytest.mark.cuda
@pytest.mark.parametrize("shape", SHAPES + [(8, 32, 128)], ids=str)
def test_kernels_match_twins_on_cuda_sync_free(shape):
    check(shape, torch.bfloat16, "cuda", None, trials=1)  # compiles
    check(shape, torch.bfloat16, "cuda", None, sync_free=True)
