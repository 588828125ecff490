"""Gated DeltaNet ops (worker.linear_attention): the chunked and recurrent twins of the delta rule
against a naive per-token reference and transformers' torch functions, slot-indexed resumption,
chunk splits, the causal conv against transformers' padded conv; the Triton kernels (conv, decode
step) interpreted on the CPU; on a GPU fla's chunked path and our kernels against the twins under
sync debug mode, and the decode steps replayed from CUDA graphs."""
from __future__ import annotations

import inspect
import os
from typing import NamedTuple

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from worker.linear_attention import causal_conv1d, conv1d_step, gated_delta_chunk, gated_delta_step  # noqa: E402
from worker.linear_attention.delta_rule_eager import gated_delta_chunked, gated_delta_recurrent  # noqa: E402

interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")


class Config(NamedTuple):
    hk: int
    hv: int
    dk: int
    dv: int
    lengths: tuple[int, ...]
    spare_slots: int = 3


CONFIGS = {
    "equal-heads": Config(2, 2, 16, 8, (1, 64, 37)),
    "gva2": Config(2, 4, 8, 16, (128, 1, 65, 3)),
    "gva4": Config(1, 4, 32, 24, (63, 130, 1, 192)),
}


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).abs().max() / want.double().abs().max().clamp_min(1e-30)).item()


def cu_of(lengths) -> list[int]:
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return cu


def delta_inputs(cfg: Config, gen: torch.Generator, dtype=torch.float32, beta_dtype=torch.float32):
    """Packed q, k, v, g, beta; a pool with random states everywhere; B distinct slots, not 0..B-1."""
    T, B = sum(cfg.lengths), len(cfg.lengths)
    q = torch.randn(T, cfg.hk, cfg.dk, generator=gen).to(dtype)
    k = torch.randn(T, cfg.hk, cfg.dk, generator=gen).to(dtype)
    v = torch.randn(T, cfg.hv, cfg.dv, generator=gen).to(dtype)
    g = -F.softplus(torch.randn(T, cfg.hv, generator=gen) * 2)  # log decay <= 0, some strong
    beta = torch.sigmoid(torch.randn(T, cfg.hv, generator=gen)).to(beta_dtype)
    state = torch.randn(B + cfg.spare_slots, cfg.hv, cfg.dk, cfg.dv, generator=gen) * 0.5
    slots = torch.randperm(B + cfg.spare_slots, generator=gen)[:B]
    return q, k, v, g, beta, state, slots


def naive_delta(q, k, v, g, beta, state, slots, cu):
    """Per sequence, token and value head, in float64: the rule as transformers writes it."""
    q, k, v, g, beta = (x.double() for x in (q, k, v, g, beta))
    group = v.shape[1] // q.shape[1]
    state = state.double().clone()
    o = torch.zeros(v.shape, dtype=torch.float64)
    for b, slot in enumerate(slots.tolist()):
        for t in range(cu[b], cu[b + 1]):
            for h in range(v.shape[1]):
                qt, kt = q[t, h // group], k[t, h // group]
                qt = qt / torch.sqrt(qt.dot(qt) + 1e-6) / q.shape[-1] ** 0.5
                kt = kt / torch.sqrt(kt.dot(kt) + 1e-6)
                s = state[slot, h] * g[t, h].exp()
                s = s + torch.outer(kt, beta[t, h] * (v[t, h] - s.t() @ kt))
                state[slot, h] = s
                o[t, h] = s.t() @ qt
    return o, state


# ==== the delta rule on the CPU ====

@pytest.mark.parametrize("name", CONFIGS)
def test_chunked_and_recurrent_twins_match_naive_from_nonzero_slots(name):
    cfg = CONFIGS[name]
    cu = cu_of(cfg.lengths)
    for trial in range(3):
        q, k, v, g, beta, state, slots = delta_inputs(cfg, torch.Generator().manual_seed(trial))
        want_o, want_state = naive_delta(q, k, v, g, beta, state, slots, cu)
        for twin in (gated_delta_chunked, gated_delta_recurrent):
            pool = state.clone()
            o = twin(q, k, v, g, beta, pool, slots, cu)
            assert o.dtype == v.dtype and o.shape == v.shape
            assert rel_err(o, want_o) < 1e-5, twin.__name__
            assert rel_err(pool, want_state) < 1e-5, twin.__name__
            assert torch.equal(pool[_others(slots, pool)], state[_others(slots, pool)])  # other slots untouched


def _others(slots: torch.Tensor, pool: torch.Tensor) -> torch.Tensor:
    keep = torch.ones(pool.shape[0], dtype=torch.bool)
    keep[slots] = False
    return keep


@pytest.mark.parametrize("name", CONFIGS)
def test_public_ops_on_cpu_match_transformers(name):
    """gated_delta_chunk against transformers' chunked torch function, one sequence at a time, and
    gated_delta_step against its recurrent one (the functions unwrapped from the fla dispatch; key
    heads repeated here, as the releases before transformers 5.2x did in the layer)."""
    from transformers.models.qwen3_next import modeling_qwen3_next as hf

    chunk_ref = inspect.unwrap(hf.torch_chunk_gated_delta_rule)
    step_ref = inspect.unwrap(hf.torch_recurrent_gated_delta_rule)
    cfg = CONFIGS[name]
    cu = cu_of(cfg.lengths)
    q, k, v, g, beta, state, slots = delta_inputs(cfg, torch.Generator().manual_seed(7))
    pool = state.clone()
    o = gated_delta_chunk(q, k, v, g, beta, pool, slots, torch.tensor(cu), cu)
    q_rep, k_rep = (x.repeat_interleave(cfg.hv // cfg.hk, dim=1) for x in (q, k))
    for b, slot in enumerate(slots.tolist()):
        part = slice(cu[b], cu[b + 1])
        want_o, want_s = chunk_ref(q_rep[None, part], k_rep[None, part], v[None, part], g[None, part], beta[None, part],
                                   initial_state=state[slot:slot + 1], output_final_state=True,
                                   use_qk_l2norm_in_kernel=True)
        assert rel_err(o[part], want_o[0]) < 1e-5 and rel_err(pool[slot], want_s[0]) < 1e-5
    step = [cu[b] for b in range(len(cfg.lengths))]  # each sequence's first token, as a decode step
    pool = state.clone()
    o = gated_delta_step(q[step], k[step], v[step], g[step], beta[step], pool, slots)
    want_o, want_s = step_ref(q_rep[step][:, None], k_rep[step][:, None], v[step][:, None], g[step][:, None],
                              beta[step][:, None], initial_state=state[slots], output_final_state=True,
                              use_qk_l2norm_in_kernel=True)
    assert rel_err(o, want_o[:, 0]) < 1e-5 and rel_err(pool[slots], want_s) < 1e-5


@pytest.mark.parametrize("split", [64, 37, 1, 128])
def test_chunk_split_resumes_exactly(split):
    """One sequence run as two chunks (state carried in its slot) equals one run, beside other
    sequences of the same batches; splits at and off the chunk size."""
    cfg = Config(2, 4, 16, 16, (150, 5))
    q, k, v, g, beta, state, slots = delta_inputs(cfg, torch.Generator().manual_seed(split))
    whole = state.clone()
    o = gated_delta_chunk(q, k, v, g, beta, whole, slots, torch.tensor(cu_of(cfg.lengths)), cu_of(cfg.lengths))
    parts = state.clone()
    first = list(range(split)) + list(range(150, 155))  # the long sequence's head, then the short one
    second = list(range(split, 150))
    o1 = gated_delta_chunk(*(x[first] for x in (q, k, v, g, beta)), parts, slots, torch.tensor(cu_of((split, 5))),
                           cu_of((split, 5)))
    o2 = gated_delta_chunk(*(x[second] for x in (q, k, v, g, beta)), parts, slots[:1],
                           torch.tensor([0, 150 - split]), [0, 150 - split])
    assert rel_err(torch.cat([o1[:split], o2, o1[split:]]), o) < 1e-5
    assert rel_err(parts, whole) < 1e-5


@pytest.mark.parametrize("name", CONFIGS)
def test_step_equals_chunk_of_one_token(name):
    cfg = CONFIGS[name]
    B = len(cfg.lengths)
    q, k, v, g, beta, state, slots = delta_inputs(cfg._replace(lengths=(1,) * B), torch.Generator().manual_seed(3))
    by_chunk, by_step = state.clone(), state.clone()
    o_chunk = gated_delta_chunk(q, k, v, g, beta, by_chunk, slots, torch.arange(B + 1), list(range(B + 1)))
    o_step = gated_delta_step(q, k, v, g, beta, by_step, slots)
    assert rel_err(o_step, o_chunk) < 1e-5 and rel_err(by_step, by_chunk) < 1e-5


def test_delta_rule_checks_shapes_on_the_host():
    cfg = CONFIGS["gva2"]
    cu = cu_of(cfg.lengths)
    q, k, v, g, beta, state, slots = delta_inputs(cfg, torch.Generator().manual_seed(0))
    ok = dict(cu_seqlens=torch.tensor(cu), cu_seqlens_host=cu)
    bad_calls = [
        lambda: gated_delta_chunk(q, k, v, g, beta, state, slots, torch.tensor(cu), cu[:-1] + [cu[-1] + 1]),
        lambda: gated_delta_chunk(q, k, v, g, beta, state, slots[:-1], **ok),
        lambda: gated_delta_chunk(q, k, v, g, beta, state, slots, torch.tensor([0, 0] + cu[1:]), [0, 0] + cu[1:]),
        lambda: gated_delta_chunk(q[:, :1].repeat(1, 3, 1), k[:, :1].repeat(1, 3, 1), v, g, beta, state, slots, **ok),
        lambda: gated_delta_chunk(q, k, v, g, beta, state.double(), slots, **ok),
        lambda: gated_delta_chunk(q, k, v, g[:, :1], beta, state, slots, **ok),
        lambda: gated_delta_step(q[:2], k[:2], v[:2], g[:2], beta[:2], state, slots),
    ]
    for call in bad_calls:
        with pytest.raises(ValueError):
            call()


# ==== the conv on the CPU ====

def conv_inputs(C: int, K: int, history: tuple[int, ...], lengths: tuple[int, ...], gen: torch.Generator,
                dtype=torch.float32, spare: int = 2):
    """Each sequence has ``history`` earlier inputs (its state: the last K-1 of them, zero-padded)
    and ``lengths`` new ones; a pool of random states elsewhere."""
    B = len(lengths)
    weight = torch.randn(C, K, generator=gen).to(dtype)
    old = [torch.randn(n, C, generator=gen).to(dtype) for n in history]
    new = [torch.randn(n, C, generator=gen).to(dtype) for n in lengths]
    state = torch.randn(B + spare, C, K - 1, generator=gen).to(dtype)
    slots = torch.randperm(B + spare, generator=gen)[:B]
    for b, h in enumerate(old):
        state[slots[b]] = F.pad(h, (0, 0, K - 1, 0))[-(K - 1):].t()
    return weight, old, new, state, slots


def hf_conv(weight, old, new):
    """transformers' prefill conv on history + new inputs (left zero padding), new outputs and the
    last K-1 inputs of each sequence."""
    from transformers.models.qwen3_next import modeling_qwen3_next as hf

    conv_fn = inspect.unwrap(hf.causal_conv1d_fn)
    K = weight.shape[1]
    outs, states = [], []
    for h, n in zip(old, new):
        seq = torch.cat([h, n]).float()
        outs.append(conv_fn(seq.t()[None], weight.float(), None, activation="silu")[0].t()[-n.shape[0]:])
        states.append(F.pad(seq, (0, 0, K - 1, 0))[-(K - 1):].t())
    return torch.cat(outs), states


CONV_CASES = {  # (C, K, history, lengths)
    "fresh-and-long": (24, 4, (0, 7, 2), (5, 1, 40)),
    "one-token-chunks": (10, 4, (3, 0, 9), (1, 1, 1)),
    "k2-wide": (130, 2, (1, 4), (33, 2)),
}


@pytest.mark.parametrize("name", CONV_CASES)
@pytest.mark.parametrize("backend", ["eager", pytest.param("triton", marks=interpreted)])
def test_causal_conv1d_resumes_like_transformers_padded_conv(name, backend):
    C, K, history, lengths = CONV_CASES[name]
    weight, old, new, state, slots = conv_inputs(C, K, history, lengths, torch.Generator().manual_seed(1))
    before = state.clone()
    want, want_states = hf_conv(weight, old, new)
    cu = cu_of(lengths)
    out = causal_conv1d(torch.cat(new), weight, state, slots, torch.tensor(cu), cu, backend=backend)
    assert out.dtype == weight.dtype and rel_err(out, want) < 1e-5
    for b, slot in enumerate(slots.tolist()):
        assert torch.equal(state[slot], want_states[b])
    others = _others(slots, state)
    assert torch.equal(state[others], before[others])


@pytest.mark.parametrize("name", CONV_CASES)
@pytest.mark.parametrize("backend", ["eager", pytest.param("triton", marks=interpreted)])
def test_conv1d_step_equals_one_token_chunks_and_transformers_update(name, backend):
    from transformers.models.qwen3_next import modeling_qwen3_next as hf

    C, K, history, lengths = CONV_CASES[name]
    weight, old, new, state, slots = conv_inputs(C, K, history, (1,) * len(lengths), torch.Generator().manual_seed(2))
    x = torch.cat(new)
    by_chunk, by_step = state.clone(), state.clone()
    B = len(lengths)
    want = causal_conv1d(x, weight, by_chunk, slots, torch.arange(B + 1), list(range(B + 1)), backend="eager")
    got = conv1d_step(x, weight, by_step, slots, backend=backend)
    assert rel_err(got, want) < 1e-5 and torch.equal(by_step, by_chunk)
    hf_state = state[slots].clone()  # transformers' update takes a [B, C, K-1] window as well
    hf_out = inspect.unwrap(hf.causal_conv1d_update)(x[:, :, None], hf_state, weight, None, "silu")
    assert rel_err(got, hf_out[:, :, 0]) < 1e-5 and torch.equal(by_step[slots], hf_state)


def test_conv_checks_shapes_on_the_host():
    weight, old, new, state, slots = conv_inputs(8, 4, (0, 0), (3, 2), torch.Generator().manual_seed(0))
    x = torch.cat(new)
    bad_calls = [
        lambda: causal_conv1d(x, weight, state, slots, torch.tensor([0, 3, 5]), [0, 3, 6]),
        lambda: causal_conv1d(x, weight, state, slots[:1], torch.tensor([0, 3, 5]), [0, 3, 5]),
        lambda: causal_conv1d(x, weight[:, :3], state, slots, torch.tensor([0, 3, 5]), [0, 3, 5]),
        lambda: causal_conv1d(x, weight, state.double(), slots, torch.tensor([0, 3, 5]), [0, 3, 5]),
        lambda: conv1d_step(x[:2], weight, state, slots[:1]),
    ]
    for call in bad_calls:
        with pytest.raises(ValueError):
            call()


# ==== our Triton kernels, interpreted ====

@interpreted
@pytest.mark.parametrize("name", CONFIGS)
def test_step_kernel_matches_twin_interpreted(name):
    cfg = CONFIGS[name]
    B = len(cfg.lengths)
    for trial in range(3):
        gen = torch.Generator().manual_seed(trial)
        q, k, v, g, beta, state, slots = delta_inputs(cfg._replace(lengths=(1,) * B), gen)
        eager, kernel = state.clone(), state.clone()
        want = gated_delta_step(q, k, v, g, beta, eager, slots, backend="eager")
        got = gated_delta_step(q, k, v, g, beta, kernel, slots, backend="triton")
        assert rel_err(got, want) < 1e-5 and rel_err(kernel, eager) < 1e-5
        assert torch.equal(kernel[_others(slots, state)], state[_others(slots, state)])


@interpreted
def test_kernels_ignore_slots_outside_the_pool():
    """A slot past the pool reads a zero state and writes nothing (raw pointers do not clamp)."""
    cfg = Config(1, 2, 8, 8, (1, 1))
    q, k, v, g, beta, state, _ = delta_inputs(cfg, torch.Generator().manual_seed(0))
    slots = torch.tensor([state.shape[0], 1])
    pool = state.clone()
    o = gated_delta_step(q, k, v, g, beta, pool, slots, backend="triton")
    zero = torch.zeros_like(state[:2])
    want = gated_delta_step(q, k, v, g, beta, zero, torch.tensor([0, 1]), backend="eager")
    assert rel_err(o[:1], want[:1]) < 1e-5 and torch.equal(pool[[0, 2, 3, 4]], state[[0, 2, 3, 4]])
    weight, _, new, conv_state, _ = conv_inputs(8, 4, (0, 0), (2, 1), torch.Generator().manual_seed(0))
    before = conv_state.clone()
    causal_conv1d(torch.cat(new), weight, conv_state, torch.tensor([-1, 99]), torch.tensor([0, 2, 3]), [0, 2, 3],
                  backend="triton")
    conv1d_step(new[0], weight, conv_state, torch.tensor([-1, 99]), backend="triton")
    assert torch.equal(conv_state, before)


# ==== on a GPU ====

GPU_CONFIGS = {  # Qwen3-Next's linear layers are Hk=16, Hv=32, Dk=Dv=128, K=4
    "qwen3-next": Config(16, 32, 128, 128, (300, 1, 64, 17), spare_slots=5),
    "equal-heads": Config(4, 4, 64, 64, (128, 3, 77)),
    "gva4-dv-differs": Config(2, 8, 128, 64, (1, 200, 63, 65, 2)),
}
GPU_TRIALS = 20


def _no_syncs(call):
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        return call()
    finally:
        torch.cuda.set_sync_debug_mode(0)


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["qwen3-next"])  # the other configs: test_linear_attention_gpu_*.py
def test_fla_chunk_and_step_kernel_match_twins_on_cuda(name):
    fla_chunk_and_step_kernel_match_twins(name)


def fla_chunk_and_step_kernel_match_twins(name: str) -> None:
    """bf16 inputs, float32 states, random lengths: fla's chunk path and our step kernel against
    the twins run on the CPU from the same inputs, without syncs (after a warm-up call that lets
    Triton autotune: autotuning itself synchronises). Each config in a file of its own: on a
    freshly started machine fla autotunes each head shape for 125-190 s (H100), and the GPU suite
    gives a file to one worker (--dist loadfile)."""
    cfg = GPU_CONFIGS[name]
    cuda = torch.device("cuda")
    for trial in range(GPU_TRIALS):
        gen = torch.Generator().manual_seed(trial)
        lengths = cfg.lengths if trial == 0 else \
            tuple(int(n) for n in torch.randint(1, 300, (len(cfg.lengths),), generator=gen))
        beta_dtype = torch.float32 if name == "equal-heads" else torch.bfloat16  # one per config: fla tunes per dtype
        inputs = delta_inputs(cfg._replace(lengths=lengths), gen, torch.bfloat16, beta_dtype)
        q, k, v, g, beta, state, slots = inputs
        cu = cu_of(lengths)
        want_state = state.clone()
        want = gated_delta_chunked(q, k, v, g, beta, want_state, slots, cu)
        dev = [x.to(cuda) for x in inputs]
        cu_dev = torch.tensor(cu, device=cuda)
        gated_delta_chunk(*dev[:5], dev[5].clone(), dev[6], cu_dev, cu)  # warm-up
        got = _no_syncs(lambda: gated_delta_chunk(*dev, cu_dev, cu))
        errs = rel_err(got.cpu(), want), rel_err(dev[5].cpu(), want_state)
        assert errs[0] < 2e-2 and errs[1] < 1e-2, (trial, errs)
        first = torch.tensor(cu[:-1])
        step_in = [x[first] for x in (q, k, v, g, beta)]
        want_state = state.clone()
        want = gated_delta_step(*step_in, want_state, slots, backend="eager")
        pool = state.to(cuda)
        step_dev = [x.to(cuda) for x in step_in]
        got = _no_syncs(lambda: gated_delta_step(*step_dev, pool, dev[6]))
        errs = rel_err(got.cpu(), want), rel_err(pool.cpu(), want_state)
        assert errs[0] < 1e-2 and errs[1] < 1e-5, (trial, errs)


@pytest.mark.cuda
@pytest.mark.parametrize("name", CONV_CASES)
def test_conv_kernels_match_twins_on_cuda(name):
    C, K, _, lengths = CONV_CASES[name]
    cuda = torch.device("cuda")
    for trial in range(GPU_TRIALS):
        gen = torch.Generator().manual_seed(trial)
        lengths = tuple(int(n) for n in torch.randint(1, 100, (len(lengths),), generator=gen))
        weight, _, new, state, slots = conv_inputs(C * 32, K, (0,) * len(lengths), lengths, gen, torch.bfloat16)
        state.normal_(generator=gen)
        cu = cu_of(lengths)
        x = torch.cat(new)
        want_state = state.clone()
        want = causal_conv1d(x, weight, want_state, slots, torch.tensor(cu), cu)
        pool, x_dev, w_dev, slots_dev = (t.to(cuda) for t in (state, x, weight, slots))
        cu_dev = torch.tensor(cu, device=cuda)
        got = _no_syncs(lambda: causal_conv1d(x_dev, w_dev, pool, slots_dev, cu_dev, cu))
        assert rel_err(got.cpu(), want) < 1e-2 and torch.equal(pool.cpu(), want_state), trial
        want = conv1d_step(x[:len(lengths)], weight, want_state, slots)
        got = _no_syncs(lambda: conv1d_step(x_dev[:len(lengths)], w_dev, pool, slots_dev))
        assert rel_err(got.cpu(), want) < 1e-2 and torch.equal(pool.cpu(), want_state), trial


@pytest.mark.cuda
def test_decode_steps_replay_from_a_cuda_graph():
    """gated_delta_step and conv1d_step captured once, replayed on new inputs copied into the
    static buffers: the same outputs and states as eager calls."""
    cfg = GPU_CONFIGS["qwen3-next"]
    B, C, K = 4, 16 * 128 * 2 + 32 * 128, 4
    cuda = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    q, k, v, g, beta, state, slots = (t.to(cuda) for t in delta_inputs(cfg._replace(lengths=(1,) * B), gen,
                                                                      torch.bfloat16))
    weight, _, new, conv_state, conv_slots = (conv_inputs(C, K, (0,) * B, (1,) * B, gen, torch.bfloat16))
    x, weight, conv_state, conv_slots = (t.to(cuda) for t in (torch.cat(new), weight, conv_state, conv_slots))
    conv_state.normal_()
    static = [t.clone() for t in (q, k, v, g, beta, x)]
    graph_state, graph_conv = state.clone(), conv_state.clone()
    gated_delta_step(*static[:5], graph_state.clone(), slots)  # compile outside the capture
    conv1d_step(static[5], weight, graph_conv.clone(), conv_slots)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o = gated_delta_step(*static[:5], graph_state, slots)
        y = conv1d_step(static[5], weight, graph_conv, conv_slots)
    graph_state.copy_(state)
    graph_conv.copy_(conv_state)
    for _ in range(3):
        fresh = [torch.randn_like(t) for t in (q, k, v)] + [-torch.rand_like(g), torch.rand_like(beta),
                                                             torch.randn_like(x)]
        for dst, src in zip(static, fresh):
            dst.copy_(src)
        graph.replay()
        want_o = gated_delta_step(*fresh[:5], state, slots)
        want_y = conv1d_step(fresh[5], weight, conv_state, conv_slots)
        torch.cuda.synchronize()
        assert torch.equal(o, want_o) and torch.equal(graph_state, state)
        assert torch.equal(y, want_y) and torch.equal(graph_conv, conv_state)
