"""``--kv-cache-dtype fp8``: the KV pools and the host tier in float8 e4m3, scale 1.

Against transformers: a checkpoint it saved (Qwen3-MoE, Mixtral, gpt-oss), its own eager attention
over K and V rounded through e4m3 (``e4m3_attention``): logits and greedy text. Against the same
runner with a pool of its compute dtype whose every read is rounded through e4m3
(``read_through_e4m3``: what a float8 pool holds, without one): the torch
attention, the Triton kernels (interpreted: chunked prefill over a cached prefix, decode with RoPE
inside), gpt-oss's sinks and window pool, the cuDNN path's composition over a float8 pool, the
host tier's page moves, and the memory plan's bytes. Each test also checks that the rounding shows,
so a pool that silently stayed in float32 fails. An unknown ``--kv-cache-dtype`` is refused in one line."""
from __future__ import annotations

import argparse
import functools
import os

import pytest
import torch

from moe_offload.kernels.triton_support import BACKEND_ENV
from scheduler.messages.to_scheduler import SamplingParams
from tests.parity_helpers import rel_err
from tests.test_kv_tier import check_restore_parity
from tests.tiny_gpt_oss import FULL, SLIDING, write_tiny_gpt_oss
from tests.tiny_hybrid import write_tiny_hybrid
from tests.tiny_models import write_tiny
from worker.attention.torch_backend import TorchAttention
from worker.batch import SequenceChunk
from worker.kv.gpu_pool import KVPool, as_stored, to_kv
from worker.kv.host_pool import HostKVPool
from worker.models.rope_tiles import to_kv as to_kv_tile  # imports triton (interpreted on the CPU: conftest)
from worker.runner import ModelRunner, RunnerConfig

FP8 = torch.float8_e4m3fn
interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")
GREEDY = SamplingParams()


def runner(model_dir, kv: str = "auto", **kw) -> ModelRunner:
    return ModelRunner(RunnerConfig(str(model_dir), device="cpu", dtype="float32", page_size=4, kv_tokens=256,
                                    kv_cache_dtype=kv, **kw))


def read_through_e4m3(r: ModelRunner) -> ModelRunner:
    """``r``'s torch attentions read their pools rounded through e4m3, as a float8 pool would hold them."""
    for attention in (r.model.attention, r.model.window_attention):
        if isinstance(attention, TorchAttention):
            gather = attention._gather
            attention._gather = lambda cache, batch, heads, gather=gather: gather(as_stored(cache, FP8), batch, heads)
    return r


def session(r: ModelRunner, prompt: list[int], split: int, tokens: list[int]) -> list[torch.Tensor]:
    """The logits of a prompt in two chunks (the second over the first's cached KV), then of one
    decode step for each of ``tokens`` (the same tokens for every runner compared)."""
    pages = r.kv_pool.allocate(r.kv_pool.pages_for(len(prompt) + len(tokens)))
    slot = -1 if r.state_pool is None else 0  # a hybrid model's recurrent state
    try:
        r.forward([SequenceChunk(prompt[:split], 0, pages, state_slot=slot)], [GREEDY], [0])
        out = [r.forward([SequenceChunk(prompt[split:], split, pages, state_slot=slot)], [GREEDY], [0]).logits[0]]
        for i, t in enumerate(tokens):
            chunk = SequenceChunk([t], len(prompt) + i, pages, state_slot=slot)
            out.append(r.forward([chunk], [GREEDY], [0]).logits[0])
        return out
    finally:
        r.kv_pool.free(pages)


def ids(n: int, seed: int, vocab: int = 128) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def check_against_rounded(got: ModelRunner, model_dir, tol: float, **kw) -> None:
    """``got`` (a float8 pool) within ``tol`` of the rounded reference at every step, and the
    unrounded pool's logits measurably away from both."""
    assert got.kv_pool.k.dtype == FP8 and got.kv_pool.page_bytes * 4 == runner(model_dir, **kw).kv_pool.page_bytes
    prompt, tokens = ids(23, 1), ids(9, 2)
    want = session(read_through_e4m3(runner(model_dir, **kw)), prompt, 13, tokens)
    exact = session(runner(model_dir, **kw), prompt, 13, tokens)
    for step, (a, b, c) in enumerate(zip(session(got, prompt, 13, tokens), want, exact)):
        assert rel_err(a, b) < tol, step
        assert rel_err(c, b) > 20 * tol, f"step {step}: e4m3 rounding should show in the logits"


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    path = tmp_path_factory.mktemp("kv_fp8_qwen3")
    write_tiny(path, "qwen3_moe", seed=5, layers=2, heads=4, kv_heads=2, head_dim=16, experts=8, top_k=2)
    return path


def test_the_torch_attention_reads_a_float8_pool_as_the_rounded_reference(qwen3):
    check_against_rounded(runner(qwen3, "fp8"), qwen3, 1e-6)


@interpreted
def test_the_triton_kernels_read_and_write_a_float8_pool_as_the_reference(qwen3, monkeypatch):
    """Interpreted: ``qk_rope``'s write of the chunks, the paged prefill kernel over the first
    chunk's keys, the decode kernel with RoPE inside (its own write and its attention to the new key)."""
    monkeypatch.setenv(BACKEND_ENV, "triton")
    check_against_rounded(runner(qwen3, "fp8", attention="triton"), qwen3, 1e-5)


def test_gpt_oss_sinks_and_window_pool_in_float8(tmp_path):
    write_tiny_gpt_oss(tmp_path, seed=3, layer_types=(SLIDING, FULL), window=8)
    got = runner(tmp_path, "fp8")
    assert got.window_pool.k.dtype == FP8  # the sliding layers' pool too
    check_against_rounded(got, tmp_path, 1e-6)


def test_a_hybrid_models_attention_layers_in_float8(tmp_path):
    """Qwen3.5: gated attention layers over a float8 pool beside linear-attention layers (their state
    stays in the compute dtype)."""
    write_tiny_hybrid(tmp_path, "qwen3_5_moe", seed=3, layer_types=("linear_attention", "full_attention"))
    got = runner(tmp_path, "fp8")
    assert got.state_pool is not None and got.kv_pool.k.dtype == FP8
    check_against_rounded(got, tmp_path, 1e-6)


def e4m3_attention(module, query, key, value, attention_mask, **kwargs):
    """transformers' own eager attention of ``module``'s family, over K and V (rotated, after the
    cache) rounded through e4m3 at scale 1: what a float8 pool hands every read."""
    import sys

    eager = sys.modules[type(module).__module__].eager_attention_forward
    return eager(module, query, as_stored(key, FP8), as_stored(value, FP8), attention_mask, **kwargs)


WRITERS = {"qwen3_moe": lambda path: write_tiny(path, "qwen3_moe", seed=5, heads=4, kv_heads=2, head_dim=16),
           "mixtral": lambda path: write_tiny(path, "mixtral", seed=5, heads=4, kv_heads=2, head_dim=16),
           "gpt_oss": lambda path: write_tiny_gpt_oss(path, seed=3, layer_types=(SLIDING, FULL), window=8)}


@pytest.mark.parametrize("family", list(WRITERS))
def test_a_float8_pool_matches_transformers_reading_e4m3(tmp_path, family):
    """A checkpoint transformers saved, its model run with the attention above (registered with
    ``AttentionInterface``, with eager attention's mask; no cache: every forward rounds every key;
    gpt-oss: its sinks and a window of 8 shorter than the prompt): Sluice's logits of a prompt
    in two chunks and of each greedy step within 1e-4, and the same 12 greedy tokens."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    from tests.tiny_hybrid import hf_greedy, hf_logits

    hf = WRITERS[family](tmp_path)
    AttentionInterface.register("sluice_e4m3", e4m3_attention)
    AttentionMaskInterface.register("sluice_e4m3", eager_mask)  # the additive mask eager attention takes
    hf.set_attn_implementation("sluice_e4m3")
    prompt = ids(19, 7)
    want = hf_greedy(hf, prompt, 12)
    got = session(runner(tmp_path, "fp8"), prompt, 9, want[:-1])
    for step, logits in enumerate(got):
        assert rel_err(logits, hf_logits(hf, prompt + want[:step])[-1]) < 1e-4, step
    assert [int(x.argmax()) for x in got] == want
    hf.set_attn_implementation("eager")  # the unrounded model parts from it: the rounding shows
    assert rel_err(got[-1], hf_logits(hf, prompt + want[:-1])[-1]) > 1e-3


def test_an_unknown_kv_cache_dtype_is_refused_in_one_line():
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "scripts/generate.py", "--kv-cache-dtype", "int8"], capture_output=True,
                          text=True, cwd=root, timeout=120)
    assert done.returncode == 2
    last = done.stderr.strip().splitlines()[-1]  # argparse's line after its usage
    assert "error: argument --kv-cache-dtype: invalid choice: 'int8'" in last and "fp8" in last


def test_the_host_tier_moves_float8_pages_bit_for_bit(qwen3):
    """A session's pages pushed out to the host and back, by the kernel's twin and by memcpy, give
    the logits of the same turn never evicted, exactly (``test_kv_tier``'s check on a float8 pool)."""
    r = ModelRunner(RunnerConfig(str(qwen3), device="cpu", dtype="float32", page_size=4, kv_tokens=160,
                                 kv_cache_dtype="fp8"))
    for mode in ("writeback", "writethrough"):
        check_restore_parity(r, [37, 40, 40, 40, 40], host_gib=1 / 1024, mode=mode)
    pool = KVPool(2, 5, 4, 2, 16, torch.float32, torch.device("cpu"), FP8)
    pool.k.view(torch.uint8).copy_(torch.randint(0, 256, pool.k.shape, dtype=torch.uint8))
    host = HostKVPool.like(pool, 3 * pool.page_bytes)
    assert host.k.dtype == FP8 and host.capacity == 3
    for method in ("kernel", "memcpy"):
        host.write_from(pool, [3, 1], [0, 2], method)
        assert torch.equal(host.k[:, [0, 2]].view(torch.uint8), pool.k[:, [3, 1]].view(torch.uint8)), method


def test_writes_saturate_and_round_as_the_kernels_do():
    x = torch.tensor([1000.0, -1000.0, 448.0, 0.3, -17.3, -17.0, 1e-9])  # -17: a tie, to the even -16
    assert to_kv(x, FP8).float().tolist() == [448.0, -448.0, 448.0, 0.3125, -18.0, -16.0, 0.0]
    assert as_stored(x, torch.float32).data_ptr() == x.data_ptr()  # a pool of x's own dtype: no copy
    pool = KVPool(1, 3, 2, 1, 4, torch.float32, torch.device("cpu"), FP8)
    pool.store(0, torch.tensor([5, 2]), x[:4].view(1, 1, 4).expand(2, 1, 4), -x[:4].view(1, 1, 4).expand(2, 1, 4))
    k, v = pool.layer_slots(0)
    assert torch.equal(k[5].float(), to_kv(x[:4], FP8).float()[None]) and torch.equal(v[2].float(), -k[2].float())


def cast_cases() -> torch.Tensor:
    """Every finite e4m3 value, the midpoints between neighbours (ties) and just either side of them,
    and values from 1e-12 to beyond the range, both signs, zeros and infinities."""
    values = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    values = values[~values.isnan()].sort().values
    mids = (values[1:] + values[:-1]) / 2
    spread = torch.randn(4096, generator=torch.Generator().manual_seed(0)) * torch.logspace(-12, 3, 4096)
    special = torch.tensor([float("inf"), -float("inf"), 1000.0, -0.0, 0.0])
    return torch.cat([values, mids, mids * (1 + 1e-6), mids * (1 - 1e-6), spread, special])


@functools.cache
def cast_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def cast(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(out_ptr + i, to_kv_tile(tl.load(x_ptr + i, mask=i < n), out_ptr.dtype.element_ty), mask=i < n)

    return cast


@pytest.mark.parametrize("device", [pytest.param("cpu", marks=interpreted),
                                    pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernels_cast_rounds_as_torch_does(device, dtype):
    """``rope_tiles.to_kv`` (the kernels' writes) against ``gpu_pool.to_kv`` (the twins'), bit for bit;
    interpreted on the CPU, where Triton's own float8 cast would round ties up and lose carries."""
    x = cast_cases().to(dtype).to(device)
    out = torch.empty(x.shape, dtype=FP8, device=device)
    cast_kernel()[(-(-x.numel() // 1024),)](x, out, x.numel(), BLOCK=1024)
    assert torch.equal(out.view(torch.uint8), to_kv(x, FP8).view(torch.uint8))


def test_the_cudnn_composition_reads_a_float8_pool_as_the_rounded_one(monkeypatch):
    """The long-prefix path's composition (its CPU twin): prefixes gathered from a float8 pool, and
    read from one run of its pages, equal the same call over a float32 pool of the rounded values."""
    from tests.test_cudnn_prefill import as_runs, composed_case
    from worker.attention import cudnn_prefill

    monkeypatch.setattr(cudnn_prefill, "PREFIX_BLOCK", 16)
    gen = torch.Generator().manual_seed(11)
    rows = [(70, 33), (0, 9), (13, 17)]
    q, k, v, k_cache, v_cache, table, _, q_lens, prefixes = composed_case(gen, 8, 2, 16, 4, rows, torch.float32, "cpu")
    k_cache, v_cache = k_cache * 100, v_cache * 100  # some past 448
    k_runs, v_runs, runs_table, runs = as_runs(k_cache, v_cache, table, rows, 4)
    rounded = [as_stored(c, FP8) for c in (k_runs, v_runs)]
    fp8 = [to_kv(c, FP8) for c in (k_runs, v_runs)]
    for r in ((), runs):
        want = cudnn_prefill.cached_prefix_attention(q, k, v, *rounded, runs_table, q_lens, prefixes, 0.25, runs=r)
        got = cudnn_prefill.cached_prefix_attention(q, k, v, *fp8, runs_table, q_lens, prefixes, 0.25, runs=r)
        exact = cudnn_prefill.cached_prefix_attention(q, k, v, k_runs, v_runs, runs_table, q_lens, prefixes, 0.25,
                                                      runs=r)
        assert torch.equal(got, want) and rel_err(exact, want) > 1e-3


def test_the_memory_plan_counts_a_byte_a_value(qwen3):
    from worker.config import ModelConfig
    from worker.runner import plan_inputs
    from moe_offload.formats import ExpertFormat

    cfg = ModelConfig.from_dir(str(qwen3))
    cpu, fmt = torch.device("cpu"), ExpertFormat(torch.float32)
    sizes = {kv: plan_inputs(cfg, RunnerConfig(str(qwen3), kv_cache_dtype=kv), fmt, torch.bfloat16, cpu, None,
                             0).kv_token_bytes for kv in ("auto", "fp8")}
    assert sizes == {"auto": 2 * 2 * cfg.kv_size * 2, "fp8": 2 * 2 * cfg.kv_size}
    assert "pages of 4 tokens in float8 e4m3" in runner(qwen3, "fp8").plan.table(16)


def test_the_option_is_checked():
    from worker.cli_options import add_runner_args, runner_config

    p = argparse.ArgumentParser()
    add_runner_args(p)
    assert runner_config(p.parse_args(["--kv-cache-dtype", "fp8"]), "m").kv_cache_dtype == "fp8"
    with pytest.raises(SystemExit):
        p.parse_args(["--kv-cache-dtype", "int8"])
    with pytest.raises(ValueError, match="--kv-cache-dtype 'int8'"):
        RunnerConfig("m", kv_cache_dtype="int8")
