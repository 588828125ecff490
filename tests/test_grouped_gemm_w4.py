"""Parity of the 4-bit (nvfp4, mxfp4) W4A16 grouped SwiGLU GEMM (moe_offload/kernels/grouped_gemm_w4*.py:
prefill and decode paths) with its eager twin, the twin with a plain per-token loop, and the host
checks.

On the CPU the kernels run interpreted (TRITON_INTERPRET=1) at tiny shapes in float32 and float16
(the interpreter's ``tl.dot`` multiplies bfloat16 as raw uint16 bits); on a GPU, bfloat16 at
qwen3-30b's and gpt-oss's shapes, every op call under sync-debug "error" once compiled, and the
decode op (and a prefill-sized batch) replayed from a CUDA graph with new routing.

Banks are random bytes (every e2m1 code, both nibbles) with random group scales: e4m3 over 2^±2
and a per-row channel scale (a wrong gate/up row offset shows), e8m0 exponents over a range of 4.
K is never a multiple of 128 here except at qwen3's shape, so the group-granular tail is masked.
"""
from __future__ import annotations

import itertools
import math
import os
from typing import NamedTuple

import pytest
import torch

if not torch.cuda.is_available():  # the interpreter is chosen when the kernel module is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from moe_offload import fp4  # noqa: E402
from moe_offload.kernels.grouped_gemm_w4_banks import GROUP, W4Bank, grouped_swiglu_w4_eager  # noqa: E402

interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")
FORMATS = ["nvfp4", "mxfp4"]
TRIALS = 20


def kernels():
    from moe_offload.kernels import grouped_gemm_w4

    return grouped_gemm_w4


def decode():
    from moe_offload.kernels import grouped_gemm_w4_decode

    return grouped_gemm_w4_decode


class Banks(NamedTuple):
    w13: torch.Tensor
    w13_scale: torch.Tensor
    w13_channel_scale: torch.Tensor | None
    w2: torch.Tensor
    w2_scale: torch.Tensor
    w2_channel_scale: torch.Tensor | None

    def w4(self, extras=None):
        """The ops' two ``W4Bank`` arguments, with ``extras``' biases."""
        b13, b2 = (None, None) if extras is None else (extras.w13_bias, extras.w2_bias)
        return (W4Bank(self.w13, self.w13_scale, self.w13_channel_scale, b13),
                W4Bank(self.w2, self.w2_scale, self.w2_channel_scale, b2))


def random_banks(num_slots, dim, inter, fmt, device="cpu", seed=0, gain=1.0):
    """Random packed bytes and scales, sized so an output has about unit (times ``gain``) spread:
    an e2m1 code's rms is about 2.9."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def bank(rows, k):
        packed = torch.randint(0, 256, (num_slots, rows, k // 2), generator=gen, device=device, dtype=torch.uint8)
        groups = (num_slots, rows, k // GROUP[fmt])
        target = gain / (2.9 * math.sqrt(k))
        if fmt == "mxfp4":
            exp = round(math.log2(target)) + 127
            return packed, torch.randint(exp - 2, exp + 2, groups, generator=gen, device=device, dtype=torch.uint8), None
        scale = 2.0 ** (torch.rand(groups, generator=gen, device=device) * 4 - 2)
        channel = target * 2.0 ** (torch.rand(num_slots, rows, generator=gen, device=device) * 2 - 1)
        return packed, scale.to(torch.float8_e4m3fn), channel

    return Banks(*bank(2 * inter, dim), *bank(dim, inter))


def quantized_banks(num_slots, dim, inter, fmt, seed=0):
    """Float weights quantized by ``moe_offload.fp4`` (as the store fill does) and the weights."""
    gen = torch.Generator().manual_seed(seed)
    w13 = torch.randn(num_slots, 2 * inter, dim, generator=gen) / math.sqrt(dim)
    w13 = w13 * 2.0 ** (torch.rand(num_slots, 2 * inter, 1, generator=gen) * 4 - 2)
    w2 = torch.randn(num_slots, dim, inter, generator=gen) / math.sqrt(inter)
    if fmt == "nvfp4":
        return Banks(*fp4.quantize_nvfp4(w13), *fp4.quantize_nvfp4(w2))
    return Banks(*fp4.quantize_mxfp4(w13), None, *fp4.quantize_mxfp4(w2), None)


class Extras(NamedTuple):
    """A trial's gpt-oss arguments: biases over ``E != S`` experts, ids, activation."""

    w13_bias: torch.Tensor | None = None
    w2_bias: torch.Tensor | None = None
    bias_ids: torch.Tensor | None = None
    activation: str = "swiglu"

    def kwargs(self):
        """The ops' keyword arguments (the biases go into the banks: ``Banks.w4``)."""
        return dict(bias_ids=self.bias_ids, activation=self.activation)


def make_extras(gen, banks, slots, with_bias, gpt_oss, bias_dtype=torch.float32, expert_of_slot=None):
    """Biases of ``S + 3`` experts indexed by ids that map each slot to an expert (a cache's view:
    the kernels take the ids as a function of the slot), and/or the clamped activation."""
    if not with_bias:
        return Extras(activation="gpt_oss" if gpt_oss else "swiglu")
    num_slots, two_i, dim = banks.w13.shape[0], banks.w13.shape[1], banks.w2.shape[1]
    experts = num_slots + 3
    if expert_of_slot is None:
        expert_of_slot = torch.randperm(experts, generator=gen)[:num_slots].to(slots.device)
    ids = expert_of_slot[slots.clamp(0, num_slots - 1)]
    b13 = torch.randn(experts, two_i, generator=gen).to(slots.device, bias_dtype)
    b2 = torch.randn(experts, dim, generator=gen).to(slots.device, bias_dtype) * 0.5
    return Extras(b13, b2, ids, "gpt_oss" if gpt_oss else "swiglu")


def make_routing(gen, num_tokens, top_k, num_slots, device="cpu"):
    """Ragged routing: a random subset of slots used (sometimes one slot takes every pair; the rest
    get none), skewed popularity; about half the time a token repeats a slot."""
    num_used = 1 if torch.rand(1, generator=gen) < 0.15 else int(torch.randint(1, num_slots + 1, (1,), generator=gen))
    used = torch.randperm(num_slots, generator=gen)[:num_used]
    probs = torch.softmax(torch.randn(len(used), generator=gen) * 2, 0)
    slots = used[torch.multinomial(probs, num_tokens * top_k, replacement=True, generator=gen)].view(num_tokens, top_k)
    if torch.rand(1, generator=gen) < 0.5:
        slots[:, -1] = slots[:, 0]
    return torch.rand(num_tokens, top_k, generator=gen).to(device), slots.to(device)


def rel_err(out, ref):
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-12)).item()


TOLERANCE = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 1.5e-2}


def run_op(path, hidden, weights, slots, banks, fmt, extras, config=None):
    """``path``: "decode", "prefill" (the ops themselves, with ``config``) or "public" (the picking op)."""
    if path == "public":
        return kernels().grouped_swiglu_w4(hidden, weights, slots, *banks.w4(extras), fmt=fmt, backend="triton",
                                           **extras.kwargs())
    op = decode().decode_grouped_swiglu_w4 if path == "decode" else kernels().fused_grouped_swiglu_w4
    return op(hidden, weights, slots, *banks.w4(extras), fmt=fmt, config=config, **extras.kwargs())


def trial_cases(banks, fmt, trials, token_counts, top_ks, dtypes, seed, device="cpu", gpt_oss_every=2,
                gain_gpt_oss=1.0, extras="mixed"):
    """``trials`` inputs (tokens, top-k, dtype in turn) with the twin's output. ``extras``: "mixed"
    gives every other trial biases and every ``gpt_oss_every``-th the clamped activation, "plain"
    none, "gpt_oss" both always."""
    gen = torch.Generator().manual_seed(seed)
    num_slots, dim = banks.w2.shape[:2]
    for trial in range(trials):
        num_tokens, top_k = token_counts[trial % len(token_counts)], top_ks[trial % len(top_ks)]
        dtype = dtypes[trial % len(dtypes)]  # with 5 dtypes, bias (odd trials) and gpt_oss (every
        # third) meet each dtype
        weights, slots = make_routing(gen, num_tokens, min(top_k, num_slots), num_slots, device)
        mixed = extras == "mixed"
        gpt_oss = trial % gpt_oss_every == gpt_oss_every - 1 if mixed else extras == "gpt_oss"
        with_bias = trial % 2 == 1 if mixed else extras == "gpt_oss"
        trial_extras = make_extras(gen, banks, slots, with_bias=with_bias, gpt_oss=gpt_oss)
        hidden = (torch.randn(num_tokens, dim, generator=gen) * (gain_gpt_oss if gpt_oss else 1.0)).to(device, dtype)
        ref = grouped_swiglu_w4_eager(hidden, weights, slots, *banks.w4(trial_extras), fmt=fmt,
                                      **trial_extras.kwargs())
        yield trial, (hidden, weights, slots, trial_extras), ref


def check_trials(path, banks, fmt, config=None, sync_free=False, **cases):
    """The op against the twin over ``trial_cases``; with ``sync_free`` the op calls run under
    ``set_sync_debug_mode("error")`` (inputs, twin and comparison outside it)."""
    cases = list(trial_cases(banks, fmt, **cases))
    if sync_free:
        torch.cuda.set_sync_debug_mode("error")
    try:
        outs = [run_op(path, h, w, s, banks, fmt, extras, config) for _, (h, w, s, extras), _ in cases]
    finally:
        if sync_free:
            torch.cuda.set_sync_debug_mode("default")
    for out, (trial, (hidden, _, slots, extras), ref) in zip(outs, cases):
        assert out.dtype == hidden.dtype and out.shape == hidden.shape
        assert rel_err(out, ref) < TOLERANCE[hidden.dtype], (trial, tuple(slots.shape), extras.activation,
                                                             extras.w13_bias is not None, rel_err(out, ref))


# ==== the twin ====

def per_token_reference(hidden, weights, slots, banks, fmt, extras):
    """Every (token, j) on its own: dequantize, two float64 matmuls, no grouping."""
    deq = fp4.dequantize_nvfp4 if fmt == "nvfp4" else (lambda q, s, c: fp4.dequantize_mxfp4(q, s))
    out = torch.zeros(hidden.shape, dtype=torch.float64)
    for t, j in itertools.product(range(slots.shape[0]), range(slots.shape[1])):
        s = int(slots[t, j])
        if not 0 <= s < banks.w13.shape[0]:
            continue
        w13 = deq(banks.w13[s], banks.w13_scale[s], None if banks.w13_channel_scale is None else banks.w13_channel_scale[s])
        w2 = deq(banks.w2[s], banks.w2_scale[s], None if banks.w2_channel_scale is None else banks.w2_channel_scale[s])
        h = w13.double() @ hidden[t].double()
        if extras.w13_bias is not None:
            h = h + extras.w13_bias[extras.bias_ids[t, j]].double()
        gate, up = h.chunk(2)
        if extras.activation == "gpt_oss":
            gate, up = gate.clamp(max=7.0), up.clamp(-7.0, 7.0)
            act = gate * torch.sigmoid(1.702 * gate) * (up + 1)
        else:
            act = torch.nn.functional.silu(gate) * up
        y = w2.double() @ act
        if extras.w2_bias is not None:
            y = y + extras.w2_bias[extras.bias_ids[t, j]].double()
        out[t] += weights[t, j].double() * y
    return out


@pytest.mark.parametrize("fmt", FORMATS)
def test_twin_matches_a_per_token_loop(fmt):
    """The twin (grouped by slot) against each pair computed alone, over quantized float weights,
    with and without biases and the clamped activation; out-of-range slots add nothing."""
    banks = quantized_banks(5, 64, 32, fmt)
    gen = torch.Generator().manual_seed(1)
    for trial in range(4):
        weights, slots = make_routing(gen, 7, 3, 5)
        slots[0, 0], slots[3, 1] = -1, 5
        extras = make_extras(gen, banks, slots, with_bias=trial % 2 == 1, gpt_oss=trial >= 2)
        hidden = torch.randn(7, 64, generator=gen) * (3.0 if trial >= 2 else 1.0)
        out = grouped_swiglu_w4_eager(hidden, weights, slots, *banks.w4(extras), fmt=fmt, **extras.kwargs())
        assert rel_err(out, per_token_reference(hidden, weights, slots, banks, fmt, extras)) < 1e-5, trial


# ==== parity, interpreted ====

# (slots, hidden, inter) x tiles: H and I multiples of the group, not of 128; BLOCK_K 32 or 64 (a
# tail of one or more groups); more slots than pairs in the last one.
CPU_SHAPES = {"nvfp4": [(5, 80, 48), (3, 48, 32), (12, 64, 32)], "mxfp4": [(5, 96, 64), (3, 64, 32), (12, 64, 32)]}
CPU_DTYPES = [torch.float32] * 4 + [torch.float16]
PREFILL_TILES = [(16, 64, 64, 2, 4, 2), (16, 64, 32, 1, 4, 2), (32, 64, 64, 4, 4, 2)]
DECODE_TILES = [dict(gate_up_n=32, gate_up_k=64, down_n=64, down_k=64, slot_down_n=64, slot_down_k=32, pair_n=32,
                     pair_k=32),
                dict(gate_up_n=32, gate_up_k=32, down_n=32, down_k=32, slot_down_n=32, slot_down_k=64, pair_n=32,
                     pair_k=64),
                dict(gate_up_n=32, gate_up_k=64, down_n=64, down_k=128, slot_down_n=64, slot_down_k=32, pair_n=32,
                     pair_k=128)]


@interpreted
@pytest.mark.parametrize("case", range(3))
@pytest.mark.parametrize("fmt", FORMATS)
def test_prefill_matches_twin_interpreted(fmt, case):
    """3 configs x 20 trials (ragged, one slot, duplicates; biases, gpt_oss; fp32 and fp16)."""
    config = kernels().BlockConfig(*PREFILL_TILES[case])
    banks = random_banks(*CPU_SHAPES[fmt][case], fmt, seed=case, gain=3.0)
    check_trials("prefill", banks, fmt, config, trials=TRIALS, token_counts=[1, 5, 9, 3], top_ks=[2, 3, 1],
                 dtypes=CPU_DTYPES, seed=case, gpt_oss_every=3)


@interpreted
@pytest.mark.parametrize("fmt", FORMATS)
def test_a_bound_on_distinct_slots_changes_no_output(fmt):
    """As the bf16 GEMM's test: a few slots of a large bank, bounded by their count, the same outputs."""
    banks = random_banks(24, 64, 32, fmt, seed=4, gain=3.0)
    gen = torch.Generator().manual_seed(4)
    slots = torch.randperm(24, generator=gen)[:3][torch.randint(0, 3, (10, 2), generator=gen)]
    hidden, weights = torch.randn(10, 64, generator=gen), torch.rand(10, 2, generator=gen)
    config = kernels().BlockConfig(*PREFILL_TILES[0])
    free = kernels().fused_grouped_swiglu_w4(hidden, weights, slots, *banks.w4(), fmt=fmt, config=config)
    bound = kernels().fused_grouped_swiglu_w4(hidden, weights, slots, *banks.w4(), fmt=fmt, config=config, groups=3)
    assert torch.equal(bound, free)


@interpreted
@pytest.mark.parametrize("case", range(3))
@pytest.mark.parametrize("fmt", FORMATS)
def test_decode_matches_twin_interpreted(fmt, case):
    """3 configs x 20 trials: one token (the per-pair gate_up), up to DECODE_MAX_TOKENS (the
    per-token down) and more (the per-slot down)."""
    config = decode().W4_DECODE_TILES._replace(**DECODE_TILES[case])
    banks = random_banks(*CPU_SHAPES[fmt][case], fmt, seed=case + 10, gain=3.0)
    check_trials("decode", banks, fmt, config, trials=TRIALS, token_counts=[1, 3, 6, 1, 4],
                 top_ks=[4, 3, 2, 2], dtypes=CPU_DTYPES, seed=case + 10, gpt_oss_every=3)


@interpreted
@pytest.mark.parametrize("fmt", FORMATS)
def test_quantized_weights_interpreted(fmt):
    """Banks from ``fp4.quantize_*`` (the store fill's), through the public op's both paths."""
    banks = quantized_banks(4, 64, 32, fmt)
    check_trials("public", banks, fmt, trials=4, token_counts=[2, 40], top_ks=[2], dtypes=[torch.float32], seed=3)


@interpreted
@pytest.mark.parametrize("path,tokens", [("decode", 1), ("decode", 3), ("decode", 6), ("prefill", 5)])
@pytest.mark.parametrize("fmt", FORMATS)
def test_out_of_range_slots_contribute_zero(fmt, path, tokens):
    banks = random_banks(4, 64, 32, fmt, seed=4)
    gen = torch.Generator().manual_seed(5)
    weights, slots = make_routing(gen, tokens, 3, 4)
    bad = torch.zeros(tokens, 3, dtype=torch.bool)
    bad[0, 0] = True
    bad[-1] = True  # the last token routes nowhere
    wild = torch.tensor([-1, 4, 4 + 7, -5, 2**40, 1 << 33])[torch.arange(int(bad.sum())) % 6]
    extras = make_extras(gen, banks, slots, with_bias=True, gpt_oss=False)
    hidden = torch.randn(tokens, 64, generator=gen)
    out = run_op(path, hidden, weights, slots.masked_scatter(bad, wild), banks, fmt, extras)
    assert torch.all(out[-1] == 0)
    ref = grouped_swiglu_w4_eager(hidden, weights.masked_fill(bad, 0.0), slots, *banks.w4(extras), fmt=fmt,
                                  **extras.kwargs())
    if tokens > 1:
        assert rel_err(out[:-1], ref[:-1]) < 1e-5


@interpreted
def test_bias_ids_outside_the_biases_add_nothing():
    banks = random_banks(4, 64, 32, "mxfp4", seed=6)
    gen = torch.Generator().manual_seed(6)
    weights, slots = make_routing(gen, 3, 2, 4)
    extras = make_extras(gen, banks, slots, with_bias=True, gpt_oss=False)
    wild = extras._replace(bias_ids=torch.where(slots == slots[0, 0], 100, extras.bias_ids))  # that slot's expert
    hidden = torch.randn(3, 64, generator=gen)
    for path in ("decode", "prefill"):
        out = run_op(path, hidden, weights, slots, banks, "mxfp4", wild)
        ref = grouped_swiglu_w4_eager(hidden, weights, slots, *banks.w4(wild), fmt="mxfp4", **wild.kwargs())
        assert rel_err(out, ref) < 1e-5


@interpreted
def test_public_op_takes_each_path_at_its_batch():
    """Up to DECODE_MAX_TOKENS tokens the per-token down, up to DECODE_MAX_PAIRS pairs the
    per-slot down, above that the align path; 2, 3 and 4 launches."""
    from tests.launch_count import count_launches

    max_tokens, max_pairs = decode().DECODE_MAX_TOKENS, decode().DECODE_MAX_PAIRS
    banks = random_banks(6, 32, 32, "mxfp4", seed=7)
    paths = {1: ("_gate_up_pair_w4_kernel", 2), max_tokens: ("_down_token_w4_kernel", 2),
             max_tokens + 1: ("_down_slot_w4_kernel", 3), max_pairs // 2 + 1: ("_align_kernel", 4)}
    gen = torch.Generator().manual_seed(7)
    for tokens, (kernel, launches) in paths.items():
        weights, slots = make_routing(gen, tokens, 2, 6)
        hidden = torch.randn(tokens, 32, generator=gen)
        with count_launches() as counter:
            out = run_op("public", hidden, weights, slots, banks, "mxfp4", Extras())
        assert rel_err(out, grouped_swiglu_w4_eager(hidden, weights, slots, *banks.w4(), fmt="mxfp4")) < 1e-5
        triton_launches = {k: v for k, v in counter.launches.items() if k.startswith("triton.")}
        assert f"triton.{kernel}" in triton_launches and sum(triton_launches.values()) == launches, (tokens,
                                                                                                    triton_launches)


def test_public_op_runs_the_twin_on_cpu_tensors():
    banks = random_banks(3, 32, 32, "nvfp4", seed=8)
    hidden, weights, slots = torch.randn(2, 32), torch.rand(2, 2), torch.tensor([[0, 2], [1, 1]])
    out = kernels().grouped_swiglu_w4(hidden, weights, slots, *banks.w4(), fmt="nvfp4", backend="eager")
    assert torch.equal(out, grouped_swiglu_w4_eager(hidden, weights, slots, *banks.w4(), fmt="nvfp4"))


# ==== host checks ====

BAD_ARGS = {
    "format": lambda b, kw: kw.update(fmt="int4"),
    "activation": lambda b, kw: kw.update(activation="gelu"),
    "packed_dtype": lambda b, kw: b.update(w13=b["w13"].view(torch.int8)),
    "scale_dtype": lambda b, kw: b.update(w2_scale=b["w2_scale"].float()),
    "scale_shape": lambda b, kw: b.update(w13_scale=b["w13_scale"][:, :, :-1]),
    "packed_shape": lambda b, kw: b.update(w2=b["w2"][:, :-1]),
    "no_channel": lambda b, kw: b.update(w13_channel_scale=None),
    "channel_shape": lambda b, kw: b.update(w2_channel_scale=b["w2_channel_scale"][:-1]),
    "one_bias": lambda b, kw: kw.update(w13_bias=torch.zeros(3, 64)),
    "bias_rows": lambda b, kw: kw.update(w13_bias=torch.zeros(3, 64), w2_bias=torch.zeros(4, 48)),
    "bias_width": lambda b, kw: kw.update(w13_bias=torch.zeros(3, 63), w2_bias=torch.zeros(3, 48)),
    "bias_ids": lambda b, kw: kw.update(bias_ids=torch.zeros(2, 3, dtype=torch.long)),
    "strided_scale": lambda b, kw: b.update(w13_scale=b["w13_scale"].transpose(1, 2).contiguous().transpose(1, 2)),
    "device": lambda b, kw: b.update(w2_scale=b["w2_scale"].to("meta")),
}


@pytest.mark.parametrize("bad", list(BAD_ARGS))
@pytest.mark.parametrize("path", ["decode", "prefill", "eager"])
def test_inconsistent_arguments_raise_before_any_launch(bad, path):
    banks = random_banks(3, 48, 32, "nvfp4")._asdict()
    kwargs = dict(fmt="nvfp4")
    BAD_ARGS[bad](banks, kwargs)
    hidden, weights, slots = torch.randn(2, 48), torch.rand(2, 2), torch.zeros(2, 2, dtype=torch.long)
    op = {"decode": decode().decode_grouped_swiglu_w4, "prefill": kernels().fused_grouped_swiglu_w4,
          "eager": grouped_swiglu_w4_eager}[path]
    with pytest.raises(ValueError):
        op(hidden, weights, slots, *Banks(**banks).w4(Extras(kwargs.pop("w13_bias", None),
                                                             kwargs.pop("w2_bias", None))), **kwargs)


def test_mxfp4_has_no_channel_scale_and_k_must_fit_its_group():
    banks = random_banks(3, 64, 32, "mxfp4")
    hidden, weights, slots = torch.randn(2, 64), torch.rand(2, 1), torch.zeros(2, 1, dtype=torch.long)
    with pytest.raises(ValueError, match="channel"):
        kernels().fused_grouped_swiglu_w4(hidden, weights, slots,
                                          *banks._replace(w2_channel_scale=torch.ones(3, 64)).w4(),
                                          fmt="mxfp4")
    nv = random_banks(3, 48, 32, "nvfp4")  # 48 columns: whole nvfp4 groups, not mxfp4 ones
    mx = Banks(nv.w13, nv.w13_scale[..., :1].view(torch.uint8), None, nv.w2, nv.w2_scale[..., :1].view(torch.uint8),
               None)
    with pytest.raises(ValueError, match="multiples of 32"):
        kernels().fused_grouped_swiglu_w4(torch.randn(2, 48), weights, slots, *mx.w4(), fmt="mxfp4")


def test_tiles_must_fit_the_group_and_the_dot():
    banks = random_banks(3, 64, 32, "nvfp4")
    hidden, weights, slots = torch.randn(2, 64), torch.rand(2, 1), torch.zeros(2, 1, dtype=torch.long)
    for tiles in [(16, 64, 16, 1, 4, 2), (16, 64, 48, 1, 4, 2), (8, 64, 32, 1, 4, 2), (16, 16, 32, 1, 4, 2)]:
        with pytest.raises(ValueError):
            kernels().fused_grouped_swiglu_w4(hidden, weights, slots, *banks.w4(), fmt="nvfp4",
                                              config=kernels().BlockConfig(*tiles))
    with pytest.raises(ValueError, match="group"):
        decode().decode_grouped_swiglu_w4(hidden, weights, slots, *random_banks(3, 64, 32, "mxfp4").w4(),
                                          fmt="mxfp4",
                                          config=decode().W4_DECODE_TILES._replace(gate_up_k=48))
    with pytest.raises(ValueError, match="at most"):
        decode().decode_grouped_swiglu_w4(torch.randn(33, 64), torch.rand(33, 2), torch.zeros(33, 2, dtype=torch.long),
                                          *banks.w4(), fmt="nvfp4")


def test_the_per_token_down_takes_long_steps_where_its_reads_are_masked_anyway():
    base, long = decode().W4_DECODE_TILES, decode().W4_DECODE_TILES._replace(**decode().W4_LONG_DOWN)
    assert decode().decode_tiles("nvfp4", 768) == base  # qwen3-30b: three whole steps of 256
    assert decode().decode_tiles("nvfp4", 2880) == long  # a masked tail either way
    assert decode().decode_tiles("mxfp4", 768) == decode().decode_tiles("mxfp4", 2880) == long


@interpreted
@pytest.mark.parametrize("fmt", FORMATS)
def test_default_decode_tiles_match_the_twin_interpreted(fmt):
    """The default tiles of each format at an intermediate size 256 does not divide (mxfp4's long
    down, and nvfp4's there), one to eight tokens."""
    check_trials("public", random_banks(12, 96, 320, fmt), fmt, trials=2, token_counts=[1, 3, 8], top_ks=[4],
                 dtypes=[torch.float32], device="cpu", seed=5)


# ==== GPU ====

GPU_SHAPES = {  # (slots, hidden, inter, top-k), extras (as each family serves; "mixed" takes every combination)
    "qwen3-30b": ((128, 2048, 768, 8), "plain"),
    "gpt-oss": ((128, 2880, 2880, 4), "gpt_oss"),  # 2880 = 22.5 x 128: the tail is masked
    "many-slots": ((512, 384, 224, 6), "mixed"),  # far more slots than pairs; I = 7 mxfp4 groups
}
DECODE_TOKENS = [1, 2, 3, 4, 5, 8]
PREFILL_TOKENS = [9, 64, 700, 2048]


@pytest.mark.cuda
@pytest.mark.parametrize("shape", list(GPU_SHAPES))
@pytest.mark.parametrize("fmt", FORMATS)
def test_cuda_parity_sync_free(fmt, shape):
    """3 shapes x 20 trials through the public op (decode and prefill sizes; ragged, empty and
    repeated slots; biases and the clamped activation as ``GPU_SHAPES`` says), bf16, default tiles,
    each call under sync-debug "error" once its kernels are compiled (a first pass over every
    size and combination)."""
    (num_slots, dim, inter, top_k), extras = GPU_SHAPES[shape]
    banks = random_banks(num_slots, dim, inter, fmt, "cuda", gain=3.0)
    sizes = DECODE_TOKENS + PREFILL_TOKENS
    cases = dict(token_counts=sizes, top_ks=[top_k], dtypes=[torch.bfloat16], device="cuda", gpt_oss_every=3,
                 extras=extras)
    check_trials("public", banks, fmt, trials=len(sizes) * (3 if extras == "mixed" else 1), seed=99, **cases)
    check_trials("public", banks, fmt, trials=TRIALS, seed=0, sync_free=True, **cases)


@pytest.mark.cuda
@pytest.mark.parametrize("fmt", FORMATS)
def test_cuda_float16_and_float32_activations(fmt):
    banks = random_banks(64, 1024, 320, fmt, "cuda")
    check_trials("public", banks, fmt, trials=8, token_counts=[1, 3, 6, 300], top_ks=[4],
                 dtypes=[torch.float16, torch.float32], device="cuda", seed=1)


def first_of_each(configs: list, keys) -> list:
    """The configs that bring a key (``keys(config)``: a set) no config before them brought."""
    seen, out = set(), []
    for config in configs:
        if keys(config) - seen:
            out.append(config)
            seen |= keys(config)
    return out


def prefill_block_m(tiles: tuple) -> set:
    return {tiles[0]}


def decode_block_fields(change: dict) -> set:
    return {field for field in change if field.endswith(("_n", "_k"))}


def test_explicit_tiles_cover_every_swept_shape():
    from scripts.bench_grouped_gemm_w4 import DECODE_SWEEP, SWEEP

    prefill = first_of_each(SWEEP, prefill_block_m)
    assert set().union(*map(prefill_block_m, prefill)) == set().union(*map(prefill_block_m, SWEEP))
    decode = first_of_each(DECODE_SWEEP, decode_block_fields)
    assert set().union(*map(decode_block_fields, decode)) == set().union(*map(decode_block_fields, DECODE_SWEEP))
    assert len(prefill) < len(SWEEP) and len(decode) <= 8 < len(DECODE_SWEEP)


@pytest.mark.cuda
@pytest.mark.parametrize("fmt", FORMATS)
def test_cuda_explicit_tiles(fmt):
    """Tiles of every loop shape the benchmark sweeps compute the same thing, against the twin: a
    prefill tile of each block_m, a decode change of each block field (``*_n``, ``*_k``). Warps,
    stages and register caps change no arithmetic; the benchmark checks every config it times
    against the default tiles (``check_same``). All 44 configs took 234 s on a fresh H100."""
    from scripts.bench_grouped_gemm_w4 import DECODE_SWEEP, SWEEP

    banks = random_banks(64, 1056, 352, fmt, "cuda")
    for tiles in first_of_each(SWEEP, prefill_block_m):
        check_trials("prefill", banks, fmt, kernels().BlockConfig(*tiles), trials=3, token_counts=[5, 300, 1024],
                     top_ks=[4], dtypes=[torch.bfloat16], device="cuda", seed=2)
    for tiles in first_of_each(DECODE_SWEEP, decode_block_fields):
        check_trials("decode", banks, fmt, decode().W4_DECODE_TILES._replace(**tiles), trials=4, token_counts=[1, 3, 6, 8],
                     top_ks=[8], dtypes=[torch.bfloat16], device="cuda", seed=3)


@pytest.mark.cuda
@pytest.mark.parametrize("num_tokens", [1, 4, 8, 64])
@pytest.mark.parametrize("fmt", FORMATS)
def test_cuda_graph_replay_with_new_routing(fmt, num_tokens, capture_graph):
    """The op captured once (decode sizes and a prefill-sized batch), replayed with new hidden,
    weights and slots written into the captured tensors."""
    banks = random_banks(64, 512, 256, fmt, "cuda")
    gen = torch.Generator().manual_seed(num_tokens)
    weights, slots = make_routing(gen, num_tokens, 8, 64, "cuda")
    expert_of_slot = torch.randperm(64 + 3, generator=gen)[:64].cuda()
    extras = make_extras(gen, banks, slots, with_bias=True, gpt_oss=True, expert_of_slot=expert_of_slot)
    hidden = torch.randn(num_tokens, 512, device="cuda").bfloat16()
    graph, out = capture_graph(lambda: run_op("public", hidden, weights, slots, banks, fmt, extras))
    for _ in range(4):
        new_weights, new_slots = make_routing(gen, num_tokens, 8, 64, "cuda")
        hidden.copy_(torch.randn_like(hidden) * 3)
        weights.copy_(new_weights)
        slots.copy_(new_slots)
        extras.bias_ids.copy_(expert_of_slot[new_slots])  # the cache's view follows its slots
        graph.replay()
        ref = grouped_swiglu_w4_eager(hidden, weights, slots, *banks.w4(extras), fmt=fmt, **extras.kwargs())
        assert rel_err(out, ref) < TOLERANCE[torch.bfloat16]


def test_the_tiles_env_changes_each_formats_tiles_and_refuses_what_is_not_a_field(monkeypatch):
    """SLUICE_W4_DECODE_TILES: how a whole decode step (bench_decode.py) times other tiles, over
    each format's own defaults (mxfp4's long down kept)."""
    from moe_offload.kernels import grouped_gemm_w4_decode as module

    monkeypatch.delenv(module.TILES_ENV, raising=False)
    assert module.decode_tiles("nvfp4", 768) == module.W4_DECODE_TILES
    long_down = module.W4_DECODE_TILES._replace(**module.W4_LONG_DOWN)
    assert module.decode_tiles("mxfp4", 768) == long_down
    monkeypatch.setenv(module.TILES_ENV, "down_early=0, down_regs=0")
    assert module.decode_tiles("nvfp4", 768) == module.W4_DECODE_TILES._replace(down_early=0, down_regs=0)
    assert module.decode_tiles("mxfp4", 768) == long_down._replace(down_early=0, down_regs=0)
    for bad in ("down_m=32", "down_regs=many", "down_regs"):
        monkeypatch.setenv(module.TILES_ENV, bad)
        with pytest.raises(ValueError, match="SLUICE_W4_DECODE_TILES"):
            module.decode_tiles("nvfp4", 768)
