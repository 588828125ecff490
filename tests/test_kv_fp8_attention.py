"""The paged Triton attention over a float8 e4m3 KV pool (``--kv-cache-dtype fp8``), interpreted on
the CPU: decode (with and without sinks and a window, split and unsplit rows), decode with RoPE
inside (its output, and the bytes it stores, against rotating, writing through ``to_kv`` and then
reading the pool), both under 16-bit queries too (which read the pool as words of two values), and
prefill (split-KV on and off), each against its eager twin; reading float8 equals reading its
rounded values from a float32 pool, bit for bit; and the pools the host checks refuse. The pools
hold values float8 cannot represent, some past its 448. (On a GPU in bf16:
``test_kv_fp8_attention_gpu.py``.)"""
from __future__ import annotations

import contextlib
import os

import pytest
import torch

# The interpreter is chosen when a kernel is first built; on a GPU the kernels compile instead.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tests.test_decode_rope import CONFIGS as ROPE_CONFIGS, rope_case  # noqa: E402
from tests.test_prefill_attention import prefill_case, rel_err  # noqa: E402
from tests.test_sink_attention import SMALL_TILE, sinks_for  # noqa: E402
from worker.attention import triton_decode  # noqa: E402
from worker.attention.triton_decode import paged_decode_attention, paged_decode_attention_eager  # noqa: E402
from worker.attention.triton_prefill import paged_prefill_attention, prefill_block_table, tile_for  # noqa: E402
from worker.kv.gpu_pool import FP8_MAX, as_stored, to_kv  # noqa: E402
from worker.models.rotary import qk_rope_eager  # noqa: E402

interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")
FP8 = torch.float8_e4m3fn
# (heads, kv_heads, head dim, page, window, sinks)
CONFIGS = [(4, 2, 16, 4, 0, False), (8, 2, 32, 16, 0, False), (4, 2, 16, 4, 8, True)]
LENGTHS = [1, 5, 8, 9, 70, 200]  # decode rows: shorter than, at and past the window, of one split and of several
ROWS = [(0, 21), (30, 9), (50, 1), (7, 3)]  # prefill rows (prefix, q_len): a prompt, a chunk, decode-like rows


def draw_pool(gen, shape, spread: float, hot: float, device="cpu") -> torch.Tensor:
    """Float32 values a pool write rounds: normal, times ``spread``, with a ``hot`` share of the
    entries past float8's largest (448 to 3000, either sign), which a write saturates."""
    x = torch.randn(shape, generator=gen) * spread
    big = (FP8_MAX + torch.rand(shape, generator=gen) * 2500) * x.sign()
    return torch.where(torch.rand(shape, generator=gen) < hot, big, x).to(device)


def fp8_pools(gen, shape, device="cpu") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Keys and values as a float8 pool stores them, and the float32 values written: few keys past
    448 (each dominates its row's scores), more values."""
    k, v = draw_pool(gen, shape, 2.0, 1e-3, device), draw_pool(gen, shape, 4.0, 1e-2, device)
    assert not torch.equal(as_stored(v, FP8), v) and (v.abs() > FP8_MAX).any()
    return to_kv(k, FP8), to_kv(v, FP8), k, v


def decode_fp8_case(gen, config, lengths, dtype=torch.float32, device="cpu"):
    """q, float8 pools (and the float32 values written to them), table, lens and sinks of one decode
    row per length."""
    heads, kv_heads, D, page, _, has_sinks = config
    q, k, _, table, lens, _ = prefill_case(gen, heads, kv_heads, D, page, [(n - 1, 1) for n in lengths],
                                           dtype=dtype, device=device)
    sinks = sinks_for(heads, gen, device) if has_sinks else None
    return q, *fp8_pools(gen, k.shape, device), table, lens, sinks


def decode(q, k, v, table, lens, config, sinks, splits=None, backend="triton"):
    D, window = config[2], config[4]
    return paged_decode_attention(q, k, v, table, lens, D ** -0.5, num_splits=splits, backend=backend,
                                  sinks=sinks, window=window)


def prefill(q, k, v, table, lens, q_lens, config, sinks, splits, rows, backend="triton"):
    heads, kv_heads, D, _, window, _ = config
    tile = SMALL_TILE if q.device.type == "cpu" else tile_for(q.dtype, D)
    blocks = prefill_block_table(q_lens, heads // kv_heads, q.device, tile, [p for p, _ in rows], splits)
    return paged_prefill_attention(q, k, v, table, lens, q_lens, D ** -0.5, blocks=blocks, sinks=sinks,
                                   window=window, backend=backend)


def prefill_fp8_case(gen, config, rows, dtype=torch.float32, device="cpu"):
    """q, float8 pools (and the float32 values written), table, lens, q_lens and sinks of ``rows``."""
    heads, kv_heads, D, page, _, has_sinks = config
    q, k, _, table, lens, q_lens = prefill_case(gen, heads, kv_heads, D, page, rows, dtype=dtype, device=device)
    sinks = sinks_for(heads, gen, device) if has_sinks else None
    return q, *fp8_pools(gen, k.shape, device), table, lens, q_lens, sinks


# ==== decode ====

@interpreted
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "-".join(map(str, c)))
def test_decode_kernel_reads_fp8_pool_as_twin(config):
    gen = torch.Generator().manual_seed(sum(config[:5]))
    q, k8, v8, _, _, table, lens, sinks = decode_fp8_case(gen, config, LENGTHS)
    want = decode(q, k8, v8, table, lens, config, sinks, backend="eager")
    for splits in (None, 1, 3):
        got = decode(q, k8, v8, table, lens, config, sinks, splits)
        assert torch.isfinite(got).all() and rel_err(got, want) < 1e-5


@interpreted
def test_decode_of_fp8_pool_equals_decode_of_its_rounded_values():
    """The same kernel over a float32 pool holding ``as_stored``'s values gives the same bits; over
    the values as drawn, another result (the rounding is seen)."""
    config = CONFIGS[2]
    q, k8, v8, k, v, table, lens, sinks = decode_fp8_case(torch.Generator().manual_seed(4), config, LENGTHS)
    got = decode(q, k8, v8, table, lens, config, sinks, splits=3)
    assert torch.equal(got, decode(q, as_stored(k, FP8), as_stored(v, FP8), table, lens, config, sinks, splits=3))
    assert rel_err(got, decode(q, k, v, table, lens, config, sinks, splits=3)) > 1e-2


# ==== decode with RoPE inside ====

def rope_fp8_case(gen, config, dtype=torch.float32, device="cpu"):
    """``rope_case`` over float8 pools, some new keys (where no norm bounds them) and values past 448."""
    q, k, k_cache, _, table, lens, rope = rope_case(gen, config, dtype, device)
    k8, v8, _, _ = fp8_pools(gen, k_cache.shape, device)
    assert lens[1] == 1 and lens[3] > 1  # row 1 attends to its new token alone; row 3 to more
    # saturated, and a -0 (views of the projection: no copy)
    rope.write.v[1, 0, :4] = torch.tensor([1000.0, -3000.0, 449.0, -1e-4])
    if rope.q_norm is None:
        k[3, 0, :2] = torch.tensor([900.0, -2000.0])
    kv_heads, D = k.shape[1:]
    write = rope.write._replace(k_cache=k8.view(-1, kv_heads, D), v_cache=v8.view(-1, kv_heads, D))
    return q, k, k8, v8, table, lens, rope._replace(write=write)


def rope_twin(q, k, k8, v8, table, lens, rope, config, sinks):
    """Rotate (``qk_rope``'s twin), store the new keys and values of rows with a token as ``to_kv``
    rounds them, through the pools' bytes, then the attention's twin over the pools."""
    q, k = qk_rope_eager(q, k, rope.positions, rope.rotary, rope.q_norm, rope.k_norm, rope.eps)
    live = lens > 0
    slots = rope.write.out_loc[live]
    k8, v8 = k8.clone(), v8.clone()
    for pool, new in ((k8, k), (v8, rope.write.v)):
        pool.view(-1, *new.shape[1:]).view(torch.uint8)[slots] = to_kv(new[live], FP8).view(torch.uint8)
    D, window = config[3], config[7]
    out = paged_decode_attention_eager(q, k8, v8, table, lens, D ** -0.5, sinks, window)
    return out, k8, v8


def check_rope(config, gen, dtype, device, tol, splits=None, guard=contextlib.nullcontext):
    """The kernel (inside ``guard()``) against ``rope_twin``: the output, and both pools byte for
    byte (in bf16, where the kernel's norm may round a key apart, nearly)."""
    q, k, k8, v8, table, lens, rope = rope_fp8_case(gen, config, dtype, device)
    sinks = sinks_for(config[1], gen, device) if config[8] else None
    want, k_want, v_want = rope_twin(q, k, k8, v8, table, lens, rope, config, sinks)
    with guard():
        got = paged_decode_attention(q, k8, v8, table, lens, config[3] ** -0.5, num_splits=splits,
                                     backend="triton", sinks=sinks, window=config[7], rope=rope, k=k)
    assert torch.isfinite(got).all() and rel_err(got, want) < tol
    assert byte_diff(v8, v_want) == (0, 0)
    moved, _ = byte_diff(k8, k_want)
    assert moved <= (0 if dtype == torch.float32 else 1e-3 * k8.numel())
    torch.testing.assert_close(k8.float(), k_want.float(), rtol=0.125, atol=2 ** -9)  # one float8 step at most


def byte_diff(got: torch.Tensor, want: torch.Tensor) -> tuple[int, int]:
    """How many bytes of two float8 pools differ, and how many of those are a zero's sign (0x80
    against 0x00: a small negative value stored as +0.0)."""
    got, want = got.view(torch.uint8), want.view(torch.uint8)
    diff = got != want
    return int(diff.sum()), int((diff & ((got | want) == 0x80)).sum())


@interpreted
@pytest.mark.parametrize("config", ROPE_CONFIGS[:3], ids=lambda c: "-".join(map(str, c)))
def test_decode_with_rope_stores_and_attends_what_the_pool_holds(config):
    """Rows of length 1 attend to their new token alone: unrounded, its value would show."""
    gen = torch.Generator().manual_seed(sum(config[:6]))
    for splits in (None, 2):
        check_rope(config, gen, torch.float32, "cpu", 1e-5, splits)


# ==== float8 words: 16-bit queries ====

WORD_CONFIGS = [(8, 2, 32, 16, 0, False), (8, 2, 64, 4, 8, True), (4, 2, 256, 16, 0, False)]  # the word path
WORD_ROPE_CONFIGS = [ROPE_CONFIGS[1], (5, 4, 2, 32, 4, 12, True, 7, True)]  # Mixtral-like; norms, window, sinks


@contextlib.contextmanager
def fp8_bytes():
    """The partial kernels reading a float8 pool as bytes, widened to the query's dtype."""
    triton_decode.FP8_WORDS = False
    try:
        yield
    finally:
        triton_decode.FP8_WORDS = True


@interpreted
@pytest.mark.parametrize("config", WORD_CONFIGS, ids=lambda c: "-".join(map(str, c)))
def test_decode_reads_fp8_pool_as_words_under_16bit_queries(config):
    """float16 queries (bf16's path, which the interpreter cannot widen float8 to): the pool is read
    as words of two values, and the result is the twin's and the byte reading's."""
    gen = torch.Generator().manual_seed(sum(config[:5]))
    q, k8, v8, _, _, table, lens, sinks = decode_fp8_case(gen, config, LENGTHS, torch.float16)
    assert triton_decode._reads_words(q, k8) and not triton_decode._reads_words(q.float(), k8)
    want = decode(q, k8, v8, table, lens, config, sinks, backend="eager")
    for splits in (None, 1, 3):
        got = decode(q, k8, v8, table, lens, config, sinks, splits)
        with fp8_bytes():
            as_bytes = decode(q, k8, v8, table, lens, config, sinks, splits)
        assert torch.isfinite(got).all() and rel_err(got, want) < 1e-3 and rel_err(got, as_bytes) < 1e-3


@interpreted
@pytest.mark.parametrize("config", WORD_ROPE_CONFIGS, ids=lambda c: "-".join(map(str, c)))
def test_decode_with_rope_reads_fp8_pool_as_words_under_16bit_queries(config):
    gen = torch.Generator().manual_seed(sum(config[:6]))
    for splits in (None, 2):
        check_rope(config, gen, torch.float16, "cpu", 2e-3, splits)


# ==== prefill ====

@interpreted
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("splits", [1, 2])
def test_prefill_kernel_reads_fp8_pool_as_twin(config, splits):
    gen = torch.Generator().manual_seed(sum(config[:5]) + splits)
    q, k8, v8, _, _, table, lens, q_lens, sinks = prefill_fp8_case(gen, config, ROWS)
    want = prefill(q, k8, v8, table, lens, q_lens, config, sinks, splits, ROWS, backend="eager")
    got = prefill(q, k8, v8, table, lens, q_lens, config, sinks, splits, ROWS)
    assert torch.isfinite(got).all() and rel_err(got, want) < 1e-5


@interpreted
def test_prefill_of_fp8_pool_equals_prefill_of_its_rounded_values():
    config = CONFIGS[2]
    q, k8, v8, k, v, table, lens, q_lens, sinks = prefill_fp8_case(torch.Generator().manual_seed(6), config, ROWS)
    got = prefill(q, k8, v8, table, lens, q_lens, config, sinks, 2, ROWS)
    rounded = prefill(q, as_stored(k, FP8), as_stored(v, FP8), table, lens, q_lens, config, sinks, 2, ROWS)
    assert torch.equal(got, rounded)
    assert rel_err(got, prefill(q, k, v, table, lens, q_lens, config, sinks, 2, ROWS)) > 1e-2


# ==== the twins and the host checks ====

@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "-".join(map(str, c)))
def test_twins_read_fp8_pool_as_its_rounded_values(config):
    gen = torch.Generator().manual_seed(sum(config[:5]))
    q, k8, v8, k, v, table, lens, sinks = decode_fp8_case(gen, config, LENGTHS)
    k, v = as_stored(k, FP8), as_stored(v, FP8)
    assert torch.equal(decode(q, k8, v8, table, lens, config, sinks, backend="eager"),
                       decode(q, k, v, table, lens, config, sinks, backend="eager"))
    q, k8, v8, k, v, table, lens, q_lens, sinks = prefill_fp8_case(gen, config, ROWS)
    k, v = as_stored(k, FP8), as_stored(v, FP8)
    assert torch.equal(prefill(q, k8, v8, table, lens, q_lens, config, sinks, 1, ROWS, backend="eager"),
                       prefill(q, k, v, table, lens, q_lens, config, sinks, 1, ROWS, backend="eager"))


@pytest.mark.parametrize("backend", ["eager", "triton"])
def test_pools_of_other_dtypes_are_refused(backend):
    """A float16 pool under bf16 queries, and float8 keys beside float32 values."""
    config = CONFIGS[0]
    q, k8, v8, k, v, table, lens, q_lens, _ = prefill_fp8_case(torch.Generator().manual_seed(1), config, ROWS[:1])
    bf16, half = q.bfloat16(), k.half()
    for args in ((bf16, half, half), (bf16, k8, v8.half()), (q, k8, v), (q, k, v8)):
        with pytest.raises(ValueError, match="k/v caches must share"):
            prefill(*args, table, lens, q_lens, config, None, 1, ROWS[:1], backend=backend)
        with pytest.raises(ValueError, match="k/v caches must share"):
            decode(args[0][:1], *args[1:], table, lens, config, None, backend=backend)
