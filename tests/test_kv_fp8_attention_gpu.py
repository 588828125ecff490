"""The paged Triton attention over a float8 e4m3 KV pool compiled on a GPU in bf16, at Qwen3's
geometry (32 query / 4 KV heads, head dim 128, pages of 16), gpt-oss-120b's (64 / 8 of 64, sinks,
a window of 128) and, for decode, a Qwen3.5 hybrid's full layers' (16 / 2 of 256), over contexts of
a few thousand tokens, each launch under sync debug mode: decode and decode with RoPE inside (its
output and the bytes it stores), each reading the pool as words of two values and as bytes, and
prefill, against the eager twins and against the same kernels over a bf16 pool holding the rounded
values. (The CPU tests, interpreted: ``test_kv_fp8_attention.py``; apart, so that the GPU suite's
workers share them.)"""
from __future__ import annotations

import contextlib
import functools

import pytest
import torch

from tests.test_kv_fp8_attention import (FP8, check_rope, decode, decode_fp8_case, fp8_bytes, prefill,
                                         prefill_fp8_case)
from tests.test_prefill_attention import rel_err
from tests.test_sink_attention import sync_debug
from worker.kv.gpu_pool import as_stored

pytestmark = pytest.mark.cuda

# (heads, kv_heads, head dim, page, window, sinks)
CONFIGS = [(32, 4, 128, 16, 0, False), (64, 8, 64, 16, 128, True)]
DECODE_CONFIGS = CONFIGS + [(16, 2, 256, 16, 0, False)]  # and a Qwen3.5 hybrid's full layers' heads
LENGTHS = [1, 100, 129, 1000, 3000, 4097, 2500, 64]
ROWS = [(0, 300), (2000, 200), (129, 1), (5, 40), (3000, 1)]
# B, heads, kv_heads, D, page, max_pages, norms, window, sinks (tests.test_decode_rope.CONFIGS' layout)
ROPE_CONFIGS = [(8, 32, 4, 128, 16, 256, True, 0, False), (8, 32, 4, 128, 16, 256, False, 0, False),
                (6, 64, 8, 64, 16, 200, False, 128, True)]
no_syncs = functools.partial(sync_debug, "cuda")  # any hidden sync inside raises


def rounded_bf16(k, v):
    """The float32 values written, as a bf16 pool holding what the float8 pool reads back."""
    return as_stored(k, FP8).bfloat16(), as_stored(v, FP8).bfloat16()


def ids(config) -> str:
    return "-".join(map(str, config))


@pytest.mark.parametrize("config", DECODE_CONFIGS, ids=ids)
def test_decode_reads_fp8_pool_on_gpu(config):
    gen = torch.Generator().manual_seed(sum(config[:5]))
    q, k8, v8, k, v, table, lens, sinks = decode_fp8_case(gen, config, LENGTHS, torch.bfloat16, "cuda")
    want = decode(q, k8, v8, table, lens, config, sinks, backend="eager")
    k16, v16 = rounded_bf16(k, v)
    for splits in (None, 1, 4):
        for reading in (contextlib.nullcontext, fp8_bytes):  # the pool as words of two values, as bytes
            with reading():
                decode(q, k8, v8, table, lens, config, sinks, splits)  # compiles
                with no_syncs():
                    got = decode(q, k8, v8, table, lens, config, sinks, splits)
            with no_syncs():
                same = decode(q, k16, v16, table, lens, config, sinks, splits)
            assert torch.isfinite(got).all() and rel_err(got, want) < 1e-2
            if reading is fp8_bytes:
                # the same up to the compiled kernels' summation order (at head dim 128, 0.04 % of the outputs
                # a bf16 step apart, H100), where the values as drawn differ by 0.9
                assert rel_err(got, same) < 1e-4
            else:  # its probabilities in float16, not bf16: as close to the float32 twin or closer
                assert rel_err(got, want) <= rel_err(same, want) + 1e-4


@pytest.mark.parametrize("config", ROPE_CONFIGS, ids=ids)
def test_decode_with_rope_stores_and_attends_what_fp8_pool_holds_on_gpu(config):
    """Qwen3's q/k norms, none (Mixtral), gpt-oss's window and sinks: the output against rotating,
    storing through ``to_kv`` and reading the pool, and the pools' bytes."""
    gen = torch.Generator().manual_seed(sum(config[:6]))
    for reading in (contextlib.nullcontext, fp8_bytes):  # the pool as words of two values, as bytes
        with reading():
            check_rope(config, gen, torch.bfloat16, "cuda", 3e-2)  # compiles
            for splits in (None, 1, 4):
                check_rope(config, gen, torch.bfloat16, "cuda", 3e-2, splits, guard=no_syncs)


@pytest.mark.parametrize("config", CONFIGS, ids=ids)
def test_prefill_reads_fp8_pool_on_gpu(config):
    gen = torch.Generator().manual_seed(sum(config[:5]))
    for rows in ([(3000, 2048)], ROWS):
        q, k8, v8, k, v, table, lens, q_lens, sinks = prefill_fp8_case(gen, config, rows, torch.bfloat16, "cuda")
        want = prefill(q, k8, v8, table, lens, q_lens, config, sinks, 1, rows, backend="eager")
        k16, v16 = rounded_bf16(k, v)
        for splits in (None, 1, 3):
            prefill(q, k8, v8, table, lens, q_lens, config, sinks, splits, rows)  # compiles
            with no_syncs():
                got = prefill(q, k8, v8, table, lens, q_lens, config, sinks, splits, rows)
                same = prefill(q, k16, v16, table, lens, q_lens, config, sinks, splits, rows)
            assert torch.isfinite(got).all() and rel_err(got, want) < 1e-2
            assert torch.equal(got, same)
