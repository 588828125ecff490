"""The decode attention with RoPE inside (``paged_decode_attention(rope=...)``,
``decode_rope_partial_kernel``): from the projection's q, k and v as they are, against ``qk_rope``'s
twin followed by the attention's twin, interpreted on the CPU and compiled in bf16 on a GPU under
sync debug mode; the new keys and values it stores against the twin's; the host checks; and whole
decode steps with RoPE inside the attention and in its own launch."""
from __future__ import annotations

import os

import pytest
import torch

# The interpreter is chosen when a kernel is first built; on a GPU the kernels compile instead.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from moe_offload.kernels.triton_support import BACKEND_ENV  # noqa: E402
from tests.test_decode_graph import decode_case  # noqa: E402
from tests.test_sink_attention import sinks_for  # noqa: E402
from worker.attention import triton_decode  # noqa: E402
from worker.attention.triton_decode import paged_decode_attention, row_splits, split_plan  # noqa: E402
from worker.models.rotary import KVWrite, RopeInputs, Rotary  # noqa: E402

interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")
# B, heads, kv_heads, D, page, max_pages, norms, window, sinks
CONFIGS = [
    (6, 4, 2, 16, 4, 12, True, 0, False),  # GQA 2, qwen3's q/k norms
    (7, 8, 1, 32, 16, 5, False, 0, False),  # GQA 8, no norms (Mixtral)
    (5, 4, 2, 16, 4, 12, False, 7, True),  # gpt-oss: a window and sinks
    (4, 3, 3, 16, 1, 40, True, 0, False),  # no GQA, a page of one token
]


def rope_case(gen, config, dtype=torch.float32, device="cpu", lens=None):
    """Raw (unrotated) q, k, v of one new token a row, caches whose rows up to each new token hold
    older keys, and the ``RopeInputs`` that store the new token at its slot (row ``seq_len - 1``
    of its page table; rows of length 0 write a scratch slot and attend to nothing)."""
    B, heads, kv_heads, D, page, max_pages, norms, _, _ = config
    num_pages = B * max_pages + 1
    q, k_cache, v_cache, table, lens = decode_case(gen, B, heads, kv_heads, D, page, max_pages, num_pages, dtype,
                                                   device, lens)
    table = torch.randperm(num_pages - 1, generator=gen)[:B * max_pages].view(B, max_pages).add(1).to(device)
    qkv = torch.randn(B, (heads + 2 * kv_heads) * D, generator=gen).to(dtype).to(device)
    q, k, v = qkv.split([heads * D, kv_heads * D, kv_heads * D], dim=-1)
    q, k, v = q.view(B, heads, D), k.view(B, kv_heads, D), v.view(B, kv_heads, D)
    last = (lens - 1).clamp(min=0)
    slot = torch.where(lens > 0, table.gather(1, (last // page)[:, None])[:, 0] * page + last % page, 0)
    rotary = Rotary(D, 1e4, max_pages * page, torch.device(device))
    weights = [None] * 2
    if norms:
        weights = [(1 + 0.5 * torch.randn(D, generator=gen)).to(dtype).to(device) for _ in range(2)]
    write = KVWrite(v, k_cache.view(-1, kv_heads, D), v_cache.view(-1, kv_heads, D), slot)
    return q, k, k_cache, v_cache, table, lens, RopeInputs(last, rotary, *weights, 1e-6, write)


def twin(q, k, k_cache, v_cache, table, lens, rope, scale, sinks, window):
    """``qk_rope``'s twin (rotates, stores the new token), then the attention's twin, on copies."""
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    kv_heads, D = k_cache.shape[2], k_cache.shape[3]
    write = rope.write._replace(k_cache=k_cache.view(-1, kv_heads, D), v_cache=v_cache.view(-1, kv_heads, D))
    q, _ = rope._replace(write=write).apply(q, k, backend="eager")
    out = paged_decode_attention(q, k_cache, v_cache, table, lens, scale, backend="eager", sinks=sinks, window=window)
    return out, k_cache, v_cache


def check_against_twin(config, gen, dtype, device, tol, splits=None, lens=None, sync_debug="default",
                       early_index=False):
    """The kernel (under ``sync_debug``; ``early_index``: its index reads before the PDL wait, as a
    model's step launches it) against the twins: output and both caches."""
    window, has_sinks = config[7], config[8]
    q, k, k_cache, v_cache, table, lens, rope = rope_case(gen, config, dtype, device, lens)
    sinks = sinks_for(config[1], gen, device) if has_sinks else None
    scale = config[3] ** -0.5
    want, k_want, v_want = twin(q, k, k_cache, v_cache, table, lens, rope, scale, sinks, window)
    scratch = k_cache[0].clone(), v_cache[0].clone()
    if device == "cuda":
        torch.cuda.set_sync_debug_mode(sync_debug)
    try:
        got = paged_decode_attention(q, k_cache, v_cache, table, lens, scale, num_splits=splits, backend="triton",
                                     sinks=sinks, window=window, rope=rope, k=k, early_index=early_index)
    finally:
        if device == "cuda":
            torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    # the new keys, rotated, and values as they are at their slots; page 0 is the scratch page, which
    # the twin writes for rows of length 0 and the kernel leaves alone (such a row has no new token)
    torch.testing.assert_close(k_cache[1:], k_want[1:], rtol=tol, atol=tol)
    assert torch.equal(v_cache[1:], v_want[1:])
    if config[3] >= 16:  # the kernel's path (below 16, qk_rope's launch writes the scratch page as the twin)
        assert torch.equal(k_cache[0], scratch[0]) and torch.equal(v_cache[0], scratch[1])
    return lens


@interpreted
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "-".join(map(str, c)))
def test_kernel_matches_rope_then_attention_twins(config):
    gen = torch.Generator().manual_seed(sum(config[:6]))
    for splits in (None, 1, 2, 3):
        lens = check_against_twin(config, gen, torch.float32, "cpu", 1e-4, splits, early_index=splits in (None, 2))
        assert (lens == 0).any() and (lens == config[4] * config[5]).any()  # empty and full rows covered


@interpreted
def test_the_new_token_in_each_split_and_block():
    """The new token at the first and last position of a split and of a block (the first block is
    read before the wait and patched, later ones as they are loaded)."""
    config = (6, 4, 2, 16, 4, 48, True, 0, False)
    splits, min_split = split_plan(6, 2, 48 * 4, num_splits=3)
    lens = [1, 64, 65, 128, 129, 192]
    cuts = [row_splits(n, splits, min_split) for n in lens]
    assert [(n - 1) % split_len for n, (_, split_len, _) in zip(lens, cuts)] == [0, 63, 0, 63, 0, 63]
    check_against_twin(config, torch.Generator().manual_seed(3), torch.float32, "cpu", 1e-4, 3, lens)


@interpreted
def test_head_dims_the_kernel_cannot_take_rotate_first():
    """A head dim below 16 takes ``rope.apply`` and the plain kernel, with the same results."""
    check_against_twin((5, 4, 2, 8, 4, 6, True, 0, False), torch.Generator().manual_seed(8), torch.float32, "cpu",
                       1e-4)


def test_host_checks_refuse_what_the_kernel_cannot_store():
    gen = torch.Generator().manual_seed(1)
    q, k, k_cache, v_cache, table, lens, rope = rope_case(gen, CONFIGS[0])
    args = (q, k_cache, v_cache, table, lens, 0.25)
    with pytest.raises(ValueError, match="needs the projection's k"):
        paged_decode_attention(*args, rope=rope)
    other = rope._replace(write=rope.write._replace(k_cache=k_cache.clone().view(-1, 2, 16)))
    with pytest.raises(ValueError, match="caches this attention reads"):
        paged_decode_attention(*args, rope=other, k=k)
    with pytest.raises(ValueError, match="positions must be"):
        paged_decode_attention(*args, rope=rope._replace(positions=rope.positions[:2]), k=k)


@interpreted
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_decode_with_rope_inside_matches_transformers(tmp_path, monkeypatch, family):
    """A checkpoint transformers saved (qwen3's q/k norms, Mixtral's none), the "triton" backend
    and every kernel interpreted: a prompt in two chunks, then 12 decode steps through the kernel with RoPE inside,
    each fed the runner's own token: fp32 logits within 1e-4 of transformers' at every step and the
    same greedy text."""
    from tests.test_model_parity import hf_logits, rel_err
    from tests.tiny_hybrid import hf_greedy
    from tests.tiny_models import write_tiny
    from worker.batch import SequenceChunk
    from worker.runner import ModelRunner, RunnerConfig
    from scheduler.messages.to_scheduler import SamplingParams

    hf = write_tiny(tmp_path, family, seed=5, heads=4, kv_heads=2, head_dim=16)
    monkeypatch.setenv(BACKEND_ENV, "triton")  # every op's kernel, interpreted
    runner = ModelRunner(RunnerConfig(str(tmp_path), device="cpu", dtype="float32", page_size=4, kv_tokens=256,
                                      attention="triton"))
    fused = []
    launch = triton_decode._launch
    monkeypatch.setattr(triton_decode, "_launch", lambda *a: fused.append(a[-2] is not None) or launch(*a))
    prompt, n = torch.randint(0, 128, (11,), generator=torch.Generator().manual_seed(5)).tolist(), 12
    want = hf_greedy(hf, prompt, n)
    pages = runner.kv_pool.allocate(runner.kv_pool.pages_for(len(prompt) + n))
    runner.forward([SequenceChunk(prompt[:6], 0, pages)], [SamplingParams()], [0])
    got = []
    for step in range(n):
        chunk = SequenceChunk(got[-1:], len(prompt) + step - 1, pages) if step else SequenceChunk(prompt[6:], 6, pages)
        out = runner.forward([chunk], [SamplingParams()], [step])
        assert rel_err(out.logits[0], hf_logits(hf, prompt + got)[-1]) < 1e-4, step
        got.append(int(out.next_tokens[0]))
    assert got == want
    assert len(fused) == (n - 1) * runner.model_config.num_layers and all(fused)  # every decode layer fused


@pytest.mark.cuda
@pytest.mark.parametrize("config", [(5, 32, 4, 128, 16, 300, True, 0, False), (8, 64, 4, 64, 16, 40, False, 128, True),
                                    (3, 16, 2, 256, 16, 700, True, 0, False)], ids=lambda c: "-".join(map(str, c[:6])))
def test_kernel_matches_twins_bf16_on_gpu_without_syncs(config):
    gen = torch.Generator().manual_seed(config[0])
    for trial in range(4):  # trials 0 and 2 compile: the index read after the PDL wait, then before it
        check_against_twin(config, gen, torch.bfloat16, "cuda", 3e-2, sync_debug="error" if trial % 2 else "default",
                           early_index=trial >= 2)


@pytest.mark.cuda
@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_graph_decode_with_rope_inside_matches_its_own_launch(tmp_path, monkeypatch, arch):
    """Whole decode steps: graphs with RoPE inside the attention (under PDL where the card has it,
    so the early reads of the older tokens' pages run beside the projection) against eager steps
    with ``qk_rope``'s own launch (``SLUICE_ROPE_INSIDE=0``): float32 logits within 1e-5."""
    from tests.test_decode_graph import decode_in_lockstep, gpu_runner
    from tests.tiny_models import write_tiny

    write_tiny(tmp_path, arch, seed=4, layers=3, heads=8, kv_heads=2, head_dim=32, experts=8, top_k=2)
    monkeypatch.setenv("SLUICE_ROPE_INSIDE", "0")
    separate = gpu_runner(str(tmp_path), "float32", False)
    monkeypatch.setenv("SLUICE_ROPE_INSIDE", "1")
    inside = gpu_runner(str(tmp_path), "float32", True)
    assert inside.model.attention.rope_inside and not separate.model.attention.rope_inside
    decode_in_lockstep(inside, separate, (1, 6, 20), 1e-5)


def test_rope_warps_come_from_the_environment():
    """``SLUICE_ROPE_WARPS`` (the benchmark's A/B of the fused kernel's warps) or 8."""
    import subprocess
    import sys

    code = "from worker.attention import triton_decode as t; print(t.ROPE_WARPS)"
    base = {k: v for k, v in os.environ.items() if k != "SLUICE_ROPE_WARPS"}
    for env, want in (({}, "8"), ({"SLUICE_ROPE_WARPS": "4"}, "4")):
        out = subprocess.run([sys.executable, "-c", code], env={**base, **env}, capture_output=True, text=True,
                             check=True, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        assert out.stdout.strip() == want
