"""The projection kernels (worker/models/linear.py) against their twin ``F.linear``, alone and with
the residual add and RMSNorm before them, at one row and at 2..MAX_ROWS rows: interpreted on the
CPU and compiled, sync-free and graph-captured, on a GPU; and which inputs they leave to the twins."""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from worker.models import linear as gemv  # noqa: E402
from worker.models.norm import add_rms_norm_eager, rms_norm_eager  # noqa: E402
from tests.launch_count import count_launches  # noqa: E402

interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")
TRIALS = 20
# N, K: rows a multiple of the block and not, K of one step and of several, a ragged K step (48)
CONFIGS = [(40, 64), (33, 48), (8, 1024), (130, 1536)]
# the rows kernel's blocks (16 rows of w): N ragged in one step and in three, N even in a step of 256
# (K <= 256: tl.dot is slow interpreted)
ROWS_CONFIGS = [(40, 64), (33, 48), (48, 256)]
ROWS = [2, 3, 8, 16]
GPU_CONFIGS = [(2048, 4096), (5120, 2048), (128, 2048), (151, 768)]  # o, qkv, router of qwen3-30b; ragged
GPU_ROWS = [1, 2, 8, 16]


def rows_of(gen: torch.Generator, rows: int, k: int, dtype: torch.dtype, device: str,
            trial: int) -> torch.Tensor:
    """``[rows, K]``; odd trials ``[1, rows, K]`` (leading dims), every fourth rows not contiguous."""
    if trial % 4 == 3:
        x = torch.randn(k, rows, generator=gen, device=device).to(dtype).t()
    else:
        x = torch.randn(rows, k, generator=gen, device=device).to(dtype)
    return x[None] if trial % 2 else x


def without_syncs(device: str, op, *args):
    """``op(*args)``, under ``set_sync_debug_mode("error")`` on the GPU."""
    if device == "cuda":
        torch.cuda.set_sync_debug_mode("error")
    try:
        return op(*args, backend="triton")
    finally:
        if device == "cuda":
            torch.cuda.set_sync_debug_mode("default")


def check(n: int, k: int, dtype: torch.dtype, device: str, rows: int = 1, trials: int = TRIALS) -> None:
    """Against float32 products of the same 16-bit inputs: within a rounding of the output."""
    gen = torch.Generator(device=device).manual_seed(n * k + rows)
    for trial in range(trials):
        x = rows_of(gen, rows, k, dtype, device, trial)
        w = (torch.randn(n, k, generator=gen, device=device) * k**-0.5).to(dtype)
        out = without_syncs(device, gemv.linear, x, w)
        want = F.linear(x.float(), w.float())
        assert out.shape == want.shape and out.dtype == dtype
        torch.testing.assert_close(out.float(), want, rtol=1e-2, atol=1e-2 * want.abs().max().item())


@interpreted
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", CONFIGS, ids=lambda c: "N{}K{}".format(*c))
def test_kernel_matches_twin_interpreted(shape, dtype):
    check(*shape, dtype, "cpu")


@interpreted
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", ROWS_CONFIGS, ids=lambda c: "N{}K{}".format(*c))
def test_rows_kernel_matches_twin_interpreted(shape, dtype, rows):
    check(*shape, dtype, "cpu", rows)


@pytest.mark.cuda
@pytest.mark.parametrize("rows", GPU_ROWS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", GPU_CONFIGS, ids=lambda c: "N{}K{}".format(*c))
def test_kernel_matches_twin_on_gpu_without_syncs(shape, dtype, rows):
    check(*shape, dtype, "cuda", rows)


@pytest.mark.cuda
@pytest.mark.parametrize("rows", [1, 8])
def test_graph_replay_reads_new_inputs(rows):
    x = torch.randn(rows, 2048, device="cuda").bfloat16()
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
@pytest.mark.parametrize("x_shape, kernel", [
    ((1, 64), "triton.gemv_kernel"), ((1, 1, 64), "triton.gemv_kernel"),
    ((2, 64), "triton.gemv_rows_kernel"), ((4, 4, 64), "triton.gemv_rows_kernel"),
])
def test_one_row_and_a_few_rows_take_their_kernels(x_shape, kernel):
    x, w = torch.randn(x_shape).bfloat16(), torch.randn(16, 64).bfloat16()
    with count_launches() as counter:
        gemv.linear(x, w, backend="triton")
    assert counter.launches == {kernel: 1}


@interpreted
@pytest.mark.parametrize("x_shape, w_shape, dtype", [
    ((gemv.MAX_ROWS + 1, 64), (16, 64), torch.bfloat16),  # more rows: cuBLAS's GEMM
    ((0, 64), (16, 64), torch.bfloat16),  # no rows
    ((1, 64), (16, 64), torch.float32),  # 32-bit: the twin
    ((4, 64), (16, 64), torch.float32),
    ((1, 24), (16, 24), torch.bfloat16),  # K not a multiple of 16
    ((4, 24), (16, 24), torch.bfloat16),
    ((1, 0), (16, 0), torch.bfloat16),  # nothing to reduce
])
def test_other_inputs_take_the_twin(x_shape, w_shape, dtype):
    x, w = torch.randn(x_shape).to(dtype), torch.randn(w_shape).to(dtype)
    with count_launches() as counter:
        out = gemv.linear(x, w, backend="triton")
    assert not any(name.startswith("triton.") for name in counter.launches)
    torch.testing.assert_close(out, F.linear(x, w))


@interpreted
@pytest.mark.parametrize("rows", [1, 4])
def test_transposed_weights_take_the_twin(rows):
    x, w = torch.randn(rows, 32).bfloat16(), torch.randn(32, 16).bfloat16().t()  # rows not contiguous
    with count_launches() as counter:
        out = gemv.linear(x, w, backend="triton")
    assert not any(name.startswith("triton.") for name in counter.launches)
    torch.testing.assert_close(out, F.linear(x, w))


def check_norm(n: int, k: int, dtype: torch.dtype, device: str, residual: bool, rows: int = 1,
               trials: int = TRIALS) -> None:
    """The fused op against the norm's twin and float32 products: the sum exact (on the GPU), the
    output within a rounding (the norm's reduction order may move a normalised element by one ulp)."""
    gen = torch.Generator(device=device).manual_seed(n + k + rows)
    for trial in range(trials):
        x = rows_of(gen, rows, k, dtype, device, trial)
        res = rows_of(gen, rows, k, dtype, device, trial) if residual else None
        norm_w = (1 + 0.1 * torch.randn(k, generator=gen, device=device)).to(dtype)
        w = (torch.randn(n, k, generator=gen, device=device) * k**-0.5).to(dtype)
        out, summed = without_syncs(device, gemv.add_rms_norm_linear, x, res, norm_w, 1e-6, w)
        if residual:
            normed, want_sum = add_rms_norm_eager(x, res, norm_w, 1e-6)
        else:
            normed, want_sum = rms_norm_eager(x, norm_w, 1e-6), x
        assert summed.shape == want_sum.shape
        if device == "cuda":  # the interpreter truncates to bf16 where the GPU rounds
            assert torch.equal(summed, want_sum)
        torch.testing.assert_close(summed, want_sum, rtol=1e-2, atol=1e-2)
        want = F.linear(normed.float(), w.float())
        torch.testing.assert_close(out.float(), want, rtol=2e-2, atol=2e-2 * want.abs().max().item())


@interpreted
@pytest.mark.parametrize("residual", [True, False], ids=["add", "first_layer"])
@pytest.mark.parametrize("shape", [(40, 64), (33, 48), (16, 1536)], ids=lambda c: "N{}K{}".format(*c))
def test_norm_fused_kernel_matches_twins_interpreted(shape, residual):
    check_norm(*shape, torch.bfloat16, "cpu", residual, trials=5)


@interpreted
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("residual", [True, False], ids=["add", "first_layer"])
@pytest.mark.parametrize("n, k, dtype", [(40, 64, torch.bfloat16), (33, 48, torch.bfloat16),
                                          (16, 256, torch.bfloat16), (33, 48, torch.float16)],
                         ids=lambda c: str(c).replace("torch.", ""))
def test_norm_fused_rows_kernel_matches_twins_interpreted(n, k, dtype, residual, rows):
    check_norm(n, k, dtype, "cpu", residual, rows, trials=5)


@pytest.mark.cuda
@pytest.mark.parametrize("rows", [1, 8])
@pytest.mark.parametrize("residual", [True, False], ids=["add", "first_layer"])
@pytest.mark.parametrize("shape", [(5120, 2048), (1152, 2048), (96, 1000 * 16)], ids=lambda c: "N{}K{}".format(*c))
def test_norm_fused_kernel_matches_twins_on_gpu_without_syncs(shape, residual, rows):
    check_norm(*shape, torch.bfloat16, "cuda", residual, rows)


@pytest.mark.cuda
def test_norm_fused_graph_replay_reads_new_inputs():
    x, res = (torch.randn(8, 2048, device="cuda").bfloat16() for _ in range(2))
    norm_w, w = torch.ones(2048, device="cuda").bfloat16(), torch.randn(5120, 2048, device="cuda").bfloat16()
    gemv.add_rms_norm_linear(x, res, norm_w, 1e-6, w)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, summed = gemv.add_rms_norm_linear(x, res, norm_w, 1e-6, w)
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        res.copy_(torch.randn_like(res))
        graph.replay()
        normed, want_sum = add_rms_norm_eager(x, res, norm_w, 1e-6)
        assert torch.equal(summed, want_sum)
        want = F.linear(normed.float(), w.float())
        torch.testing.assert_close(out.float(), want, rtol=2e-2, atol=2e-2 * want.abs().max().item())


@interpreted
@pytest.mark.parametrize("rows, launches", [
    (1, {"triton.gemv_kernel": 1}),
    (8, {"triton.gemv_rows_kernel": 1}),
    (gemv.MAX_ROWS + 1, {"triton.add_rms_norm_kernel": 1, "aten.mm": 1}),  # the norm, then the GEMM
])
def test_norm_fused_up_to_max_rows(rows, launches):
    x, res = torch.randn(rows, 32).bfloat16(), torch.randn(rows, 32).bfloat16()
    norm_w, w = torch.ones(32).bfloat16(), torch.randn(16, 32).bfloat16()
    with count_launches() as counter:
        out, summed = gemv.add_rms_norm_linear(x, res, norm_w, 1e-6, w, backend="triton")
    assert counter.launches == launches
    normed, want_sum = add_rms_norm_eager(x, res, norm_w, 1e-6)
    torch.testing.assert_close(summed, want_sum, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(out, F.linear(normed, w), rtol=2e-2, atol=0.1)


def test_block_k_divides_k():
    assert [gemv.block_k(k) for k in (4096, 2048, 768, 48, 24, 16, 8)] == [1024, 1024, 256, 16, 0, 16, 0]
    assert [gemv.block_k(k, 256) for k in (4096, 768, 48)] == [256, 256, 16]
