"""The one-row projection kernel (worker/models/linear.py) against its twin ``F.linear``, alone and
with the residual add and RMSNorm before it: interpreted on the CPU and compiled, sync-free and
graph-captured, on a GPU; and which inputs it leaves to the twins."""
from __future__ import annotations

import os
from collections import Counter

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from worker.models import linear as gemv  # noqa: E402
from worker.models.norm import add_rms_norm_eager, rms_norm_eager  # noqa: E402
from tests.launch_count import count_launches, sync_errors  # noqa: E402

interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")
TRIALS = 20
# N, K: rows a multiple of the block and not, K of one step and of several, a ragged K step (48)
CONFIGS = [(40, 64), (33, 48), (8, 1024), (130, 1536)]
GPU_CONFIGS = [(2048, 4096), (5120, 2048), (128, 2048), (151, 768)]  # o, qkv, router of qwen3-30b; ragged


def check(n: int, k: int, dtype: torch.dtype, device: str, trials: int = TRIALS) -> None:
    """Against float32 products of the same 16-bit inputs: within a rounding of the output."""
    gen = torch.Generator(device=device).manual_seed(n * k)
    for trial in range(trials):
        x = torch.randn(1, k, generator=gen, device=device).to(dtype)
        w = (torch.randn(n, k, generator=gen, device=device) * k**-0.5).to(dtype)
        if trial % 2:
            x = x[None]  # [1, 1, K]: leading dims of one row
        if device == "cuda":
            torch.cuda.set_sync_debug_mode("error")
        try:
            out = gemv.linear(x, w, backend="triton")
        finally:
            if device == "cuda":
                torch.cuda.set_sync_debug_mode("default")
        want = F.linear(x.float(), w.float())
        assert out.shape == want.shape and out.dtype == dtype
        torch.testing.assert_close(out.float(), want, rtol=1e-2, atol=1e-2 * want.abs().max().item())


# the whole-tile load (a power-of-two K; the step loop otherwise) forced on and off; on a GPU also
# the default (whole under PDL), which on the CPU is the step loop
WHOLE_CPU = pytest.mark.parametrize("whole", [True, False], ids=["whole", "steps"])
WHOLE = pytest.mark.parametrize("whole", [True, False, None], ids=["whole", "steps", "default"])


@interpreted
@WHOLE_CPU
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", CONFIGS, ids=lambda c: "N{}K{}".format(*c))
def test_kernel_matches_twin_interpreted(shape, dtype, whole, monkeypatch):
    monkeypatch.setattr(gemv, "WHOLE_TILE", whole)
    check(*shape, dtype, "cpu", trials=5 if whole else TRIALS)


@pytest.mark.cuda
@WHOLE
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", GPU_CONFIGS, ids=lambda c: "N{}K{}".format(*c))
def test_kernel_matches_twin_on_gpu_without_syncs(shape, dtype, whole, monkeypatch):
    monkeypatch.setattr(gemv, "WHOLE_TILE", whole)
    check(*shape, dtype, "cuda")


@pytest.mark.cuda
def test_graph_replay_reads_new_inputs():
    x = torch.randn(1, 2048, device="cuda").bfloat16()
    w = torch.randn(2048, 2048, device="cuda").bfloat16()
    gemv.linear(x, w)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gemv.linear(x, w)
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.testing.assert_close(out.float(), F.linear(x.float(), w.float()), rtol=1e-2, atol=0.1)


@interpreted
@pytest.mark.parametrize("x_shape, w_shape, dtype", [
    ((2, 64), (16, 64), torch.bfloat16),  # two rows: cuBLAS's GEMM
    ((1, 64), (16, 64), torch.float32),  # 32-bit: the twin
    ((1, 24), (16, 24), torch.bfloat16),  # K not a multiple of 16
    ((1, 0), (16, 0), torch.bfloat16),  # nothing to reduce
])
def test_other_inputs_take_the_twin(x_shape, w_shape, dtype):
    x, w = torch.randn(x_shape).to(dtype), torch.randn(w_shape).to(dtype)
    with count_launches() as counter:
        out = gemv.linear(x, w, backend="triton")
    assert not any(name.startswith("triton.") for name in counter.launches)
    torch.testing.assert_close(out, F.linear(x, w))


@interpreted
def test_transposed_weights_take_the_twin():
    x, w = torch.randn(1, 32).bfloat16(), torch.randn(32, 16).bfloat16().t()  # rows not contiguous
    with count_launches() as counter:
        out = gemv.linear(x, w, backend="triton")
    assert "triton.gemv_kernel" not in counter.launches
    torch.testing.assert_close(out, F.linear(x, w))


def check_norm(n: int, k: int, dtype: torch.dtype, device: str, residual: bool, trials: int = TRIALS) -> None:
    """The fused op against the norm's twin and float32 products: the sum exact (on the GPU), the
    output within a rounding (the norm's reduction order may move a normalised element by one ulp)."""
    gen = torch.Generator(device=device).manual_seed(n + k)
    for _ in range(trials):
        x = torch.randn(1, k, generator=gen, device=device).to(dtype)
        res = torch.randn(1, k, generator=gen, device=device).to(dtype) if residual else None
        norm_w = (1 + 0.1 * torch.randn(k, generator=gen, device=device)).to(dtype)
        w = (torch.randn(n, k, generator=gen, device=device) * k**-0.5).to(dtype)
        if device == "cuda":
            torch.cuda.set_sync_debug_mode("error")
        try:
            out, summed = gemv.add_rms_norm_linear(x, res, norm_w, 1e-6, w, backend="triton")
        finally:
            if device == "cuda":
                torch.cuda.set_sync_debug_mode("default")
        if residual:
            normed, want_sum = add_rms_norm_eager(x, res, norm_w, 1e-6)
        else:
            normed, want_sum = rms_norm_eager(x, norm_w, 1e-6), x
        if device == "cuda":  # the interpreter truncates to bf16 where the GPU rounds
            assert torch.equal(summed, want_sum)
        torch.testing.assert_close(summed, want_sum, rtol=1e-2, atol=1e-2)
        want = F.linear(normed.float(), w.float())
        torch.testing.assert_close(out.float(), want, rtol=2e-2, atol=2e-2 * want.abs().max().item())


@interpreted
@WHOLE_CPU
@pytest.mark.parametrize("residual", [True, False], ids=["add", "first_layer"])
@pytest.mark.parametrize("shape", [(40, 64), (33, 48), (16, 1536)], ids=lambda c: "N{}K{}".format(*c))
def test_norm_fused_kernel_matches_twins_interpreted(shape, residual, whole, monkeypatch):
    monkeypatch.setattr(gemv, "WHOLE_TILE", whole)
    check_norm(*shape, torch.bfloat16, "cpu", residual, trials=5)


@pytest.mark.cuda
@WHOLE
@pytest.mark.parametrize("residual", [True, False], ids=["add", "first_layer"])
@pytest.mark.parametrize("shape", [(5120, 2048), (1152, 2048), (96, 1000 * 16)], ids=lambda c: "N{}K{}".format(*c))
def test_norm_fused_kernel_matches_twins_on_gpu_without_syncs(shape, residual, whole, monkeypatch):
    monkeypatch.setattr(gemv, "WHOLE_TILE", whole)
    check_norm(*shape, torch.bfloat16, "cuda", residual)


@interpreted
def test_norm_fused_on_two_rows_takes_the_norm_then_the_gemm():
    x, res = torch.randn(2, 32).bfloat16(), torch.randn(2, 32).bfloat16()
    norm_w, w = torch.ones(32).bfloat16(), torch.randn(16, 32).bfloat16()
    with count_launches() as counter:
        out, summed = gemv.add_rms_norm_linear(x, res, norm_w, 1e-6, w, backend="triton")
    assert counter.launches["triton.add_rms_norm_kernel"] == 1 and "triton.gemv_kernel" not in counter.launches
    normed, want_sum = add_rms_norm_eager(x, res, norm_w, 1e-6)
    torch.testing.assert_close(summed, want_sum, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(out, F.linear(normed, w), rtol=2e-2, atol=0.1)


def test_block_k_divides_k():
    assert [gemv.block_k(k) for k in (4096, 2048, 768, 48, 24, 16, 8)] == [1024, 1024, 256, 16, 0, 16, 0]


def test_a_k_without_a_long_dividing_step_takes_long_masked_steps():
    """gpt-oss's K = 2880 (largest power-of-two divisor 64) reads three steps of 1024, the last masked."""
    assert [tuple(gemv.gemv_tiles(k)) for k in (4096, 2048, 768, 2880, 48)] == [
        (1024, 16), (1024, 4), (256, 4), (1024, 4), (64, 4)]


# ==== the shared expert's down projection, its SwiGLU before and its gate and sum after ====

def check_gated(n: int, k: int, dtype: torch.dtype, device: str, trials: int = TRIALS) -> None:
    """``add + sigmoid(logit) * linear(silu(gate) * up, w)`` against the same ops in torch: within
    a rounding of the output (the twin rounds after each op, as the kernel does)."""
    gen = torch.Generator(device=device).manual_seed(n * k + 1)
    for _ in range(trials):
        x = (torch.randn(1, 2 * k + 1, generator=gen, device=device) * 2).to(dtype)
        w = (torch.randn(n, k, generator=gen, device=device) * k**-0.5).to(dtype)
        add = torch.randn(1, n, generator=gen, device=device).to(dtype)
        if device == "cuda":
            torch.cuda.set_sync_debug_mode("error")
        try:
            out = gemv.swiglu_linear_gated_add(x, w, add, backend="triton")
        finally:
            if device == "cuda":
                torch.cuda.set_sync_debug_mode("default")
        gate, up, logit = x.split([k, k, 1], dim=-1)
        want = add + torch.sigmoid(logit) * F.linear(F.silu(gate) * up, w)
        assert out.shape == want.shape and out.dtype == dtype
        torch.testing.assert_close(out.float(), want.float(), rtol=2e-2, atol=2e-2 * want.abs().max().item())


@interpreted
@WHOLE_CPU
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", [(40, 64), (33, 48), (16, 512)], ids=lambda c: "N{}K{}".format(*c))
def test_gated_kernel_matches_twin_interpreted(shape, dtype, whole, monkeypatch):
    monkeypatch.setattr(gemv, "WHOLE_TILE", whole)
    with count_launches() as counter:
        check_gated(*shape, dtype, "cpu", trials=5)
    assert counter.launches["triton.gemv_kernel"] == 5  # one launch a call, nothing else


@interpreted
def test_gated_on_two_rows_or_float32_takes_the_twin():
    for rows, dtype in ((2, torch.bfloat16), (1, torch.float32)):
        x, w, add = torch.randn(rows, 65).to(dtype), torch.randn(16, 32).to(dtype), torch.randn(rows, 16).to(dtype)
        with count_launches() as counter:
            out = gemv.swiglu_linear_gated_add(x, w, add, backend="triton")
        assert "triton.gemv_kernel" not in counter.launches
        gate, up, logit = x.split([32, 32, 1], dim=-1)
        torch.testing.assert_close(out, add + torch.sigmoid(logit) * F.linear(F.silu(gate) * up, w))


@pytest.mark.cuda
@WHOLE
@pytest.mark.parametrize("shape", [(2048, 512), (2048, 768), (151, 1024)], ids=lambda c: "N{}K{}".format(*c))
def test_gated_kernel_matches_twin_on_gpu_without_syncs(shape, whole, monkeypatch):
    """Qwen3.5-35B-A3B's and Qwen3-Next's shared-expert shapes, and a ragged one."""
    monkeypatch.setattr(gemv, "WHOLE_TILE", whole)
    check_gated(*shape, torch.bfloat16, "cuda")


# ==== a reduction step that does not divide K: the tail step is masked ====

MASKED = [(gemv.GemvTiles(64, 4), (33, 48)), (gemv.GemvTiles(1024, 4), (40, 1536)), (gemv.GemvTiles(32, 1), (16, 80))]


@interpreted
@pytest.mark.parametrize("tiles, shape", MASKED, ids=lambda v: str(v))
def test_masked_steps_match_the_twins_interpreted(tiles, shape, monkeypatch):
    monkeypatch.setattr(gemv, "TILES", tiles)
    monkeypatch.setattr(gemv, "WHOLE_TILE", False)
    check(*shape, torch.bfloat16, "cpu", trials=3)
    check_norm(*shape, torch.bfloat16, "cpu", True, trials=3)
    check_gated(*shape, torch.bfloat16, "cpu", trials=3)


@pytest.mark.cuda
@pytest.mark.parametrize("tiles", [gemv.GemvTiles(1024, 4), gemv.GemvTiles(512, 8), gemv.GemvTiles(2048, 16)],
                         ids=lambda t: f"k{t.block_k}w{t.warps}")
@pytest.mark.parametrize("shape", [(5120, 2880), (2880, 4096), (131, 2880)], ids=lambda c: "N{}K{}".format(*c))
def test_masked_steps_match_the_twins_on_gpu_without_syncs(tiles, shape, monkeypatch):
    """gpt-oss's qkv (K 2880, which no power-of-two step above 64 divides), its o, a ragged router."""
    monkeypatch.setattr(gemv, "TILES", tiles)
    check(*shape, torch.bfloat16, "cuda", trials=4)
    check_norm(*shape, torch.bfloat16, "cuda", True, trials=4)
    check_gated(*shape, torch.bfloat16, "cuda", trials=4)


# ==== a bias (gpt-oss's projections), added to the float32 sum ====

def launched(fn, device: str) -> tuple[torch.Tensor, dict[str, int]]:
    """``fn()`` and its launches by name: counted by the interpreter on the CPU (``count_launches``), by
    the profiler's kernels on a GPU, there under sync-debug mode."""
    if device == "cpu":
        with count_launches() as counter:
            out = fn()
        return out, dict(counter.launches)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        with sync_errors():
            out = fn()
        torch.cuda.synchronize()
    kernels = Counter(f"triton.{e.name}" for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    return out, dict(kernels)


def check_bias(n: int, k: int, device: str, norm: bool, trials: int = 4) -> None:
    """``linear(x, w, bias)`` (and with the norm before it) against float32 products plus the bias:
    within a rounding of the output, and the twin (``F.linear(x, w, bias)``) alike."""
    gen = torch.Generator(device=device).manual_seed(n * k + 3)
    for _ in range(trials):
        x, res = (torch.randn(1, k, generator=gen, device=device).bfloat16() for _ in range(2))
        w = (torch.randn(n, k, generator=gen, device=device) * k**-0.5).bfloat16()
        bias = (4 * torch.randn(n, generator=gen, device=device)).bfloat16()  # far from zero, as gpt-oss's
        norm_w = (1 + 0.1 * torch.randn(k, generator=gen, device=device)).bfloat16()

        def run():
            if norm:
                return gemv.add_rms_norm_linear(x, res, norm_w, 1e-6, w, bias, backend="triton")[0]
            return gemv.linear(x, w, bias, backend="triton")

        out, launches = launched(run, device)
        assert launches == {"triton.gemv_kernel": 1}, launches  # the bias (and the norm) inside its launch
        inp = add_rms_norm_eager(x, res, norm_w, 1e-6)[0] if norm else x
        want = F.linear(inp.float(), w.float(), bias.float())
        torch.testing.assert_close(out.float(), want, rtol=2e-2, atol=2e-2 * want.abs().max().item())
        twin = gemv.add_rms_norm_linear(x, res, norm_w, 1e-6, w, bias, backend="eager")[0] if norm \
            else gemv.linear(x, w, bias, backend="eager")
        torch.testing.assert_close(twin.float(), want, rtol=2e-2, atol=2e-2 * want.abs().max().item())


@interpreted
@pytest.mark.parametrize("norm", [False, True], ids=["plain", "norm"])
@pytest.mark.parametrize("shape", [(40, 64), (33, 48), (16, 1536)], ids=lambda c: "N{}K{}".format(*c))
def test_bias_inside_the_launch_interpreted(shape, norm):
    check_bias(*shape, "cpu", norm, trials=2)


def test_a_bias_the_kernel_cannot_read_takes_the_twin():
    """A strided bias is the twin's (same result); one of another shape or dtype is refused by the
    twin as torch refuses it, never read by the kernel."""
    x, w = torch.randn(1, 32).bfloat16(), torch.randn(16, 32).bfloat16()
    strided = torch.randn(32).bfloat16()[::2]
    with count_launches() as counter:
        out = gemv.linear(x, w, strided, backend="triton")
    assert "triton.gemv_kernel" not in counter.launches
    torch.testing.assert_close(out, F.linear(x, w, strided.contiguous()))
    for bias in (torch.randn(8).bfloat16(), torch.randn(16)):
        with count_launches() as counter, pytest.raises(RuntimeError):
            gemv.linear(x, w, bias, backend="triton")
        assert "triton.gemv_kernel" not in counter.launches


@pytest.mark.cuda
@pytest.mark.parametrize("norm", [False, True], ids=["plain", "norm"])
@pytest.mark.parametrize("shape", [(5120, 2880), (2880, 4096), (128, 2880), (2048, 2048)],
                         ids=lambda c: "N{}K{}".format(*c))
def test_bias_inside_the_launch_on_gpu_without_syncs(shape, norm):
    """gpt-oss's qkv, o and router shapes, and an even one."""
    check_bias(*shape, "cuda", norm)
