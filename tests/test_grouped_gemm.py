"""Parity of the Triton grouped SwiGLU GEMM with its eager twin, its alignment step, and its
host-side checks. Interpreted on the CPU (TRITON_INTERPRET=1, tiny sizes, fp32); compiled,
sync-free and CUDA-graph captured on a GPU (bf16)."""
from __future__ import annotations

import math
import os

import pytest
import torch

# The interpreter is chosen when a kernel is decorated, i.e. when the kernel module is first
# imported, which happens lazily inside the tests; on a GPU the kernels must compile instead.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from moe_offload.grouped import grouped_swiglu, grouped_swiglu_eager  # noqa: E402

interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")


def kernels():
    from moe_offload.kernels import grouped_gemm

    return grouped_gemm


def make_banks(num_slots, dim, inter, dtype=torch.float32, device="cpu", seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    w13 = torch.randn(num_slots, 2 * inter, dim, generator=gen, device=device) / math.sqrt(dim)
    w2 = torch.randn(num_slots, dim, inter, generator=gen, device=device) / math.sqrt(inter)
    return w13.to(dtype), w2.to(dtype)


def make_routing(case, num_tokens, top_k, num_slots, device="cpu", seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    slots = torch.randint(0, num_slots, (num_tokens, top_k), generator=gen, device=device)
    weights = torch.rand(num_tokens, top_k, generator=gen, device=device)
    if case == "duplicates":  # one slot twice in a row
        slots[:, -1] = slots[:, 0]
    elif case == "one_slot":
        slots.fill_(num_slots - 1)
    elif case == "zero_weights":
        weights[torch.rand(num_tokens, top_k, generator=gen, device=device) < 0.5] = 0.0
    return weights, slots


def rel_err(out, ref):
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-12)).item()


def padded_groups(slots, num_slots, block_m):
    counts = torch.bincount(slots[(slots >= 0) & (slots < num_slots)], minlength=num_slots)
    return int(((counts + block_m - 1) // block_m * block_m).sum())


# ==== alignment ====

@pytest.mark.parametrize("block_m", [1, 4, 16, 64])
def test_max_blocks_bounds_every_routing(block_m):
    gen = torch.Generator().manual_seed(block_m)
    for trial in range(200):
        num_pairs = int(torch.randint(1, 300, (1,), generator=gen))
        num_slots = int(torch.randint(1, 50, (1,), generator=gen)) if trial % 2 else 6144
        slots = torch.randint(0, min(num_slots, 1 + trial), (num_pairs,), generator=gen)
        blocks = padded_groups(slots, num_slots, block_m) // block_m
        assert blocks <= kernels().max_blocks(num_pairs, num_slots, block_m)
    assert kernels().max_blocks(8, 6144, 16) == 8  # decode: no O(N) capacity


@pytest.mark.parametrize("block_m", [1, 16, 128])
def test_max_blocks_under_a_bound_on_distinct_slots(block_m):
    """A prefill chunk over a cache of thousands of slots names at most a layer's experts (one slot
    each): bounded by that count, the rows are sized by it, not by the cache (2k tokens x 8 over
    6,144 slots: 6,224 blocks of 128, 255 for 128 experts), and still hold every such routing."""
    grouped_gemm = kernels()
    assert grouped_gemm.max_blocks(16384, 6144, 128) == 6224
    assert grouped_gemm.max_blocks(16384, 6144, 128, groups=128) == 255
    assert grouped_gemm.max_blocks(16384, 64, 128, groups=128) == grouped_gemm.max_blocks(16384, 64, 128)
    gen = torch.Generator().manual_seed(block_m)
    for _ in range(100):
        experts = int(torch.randint(1, 40, (1,), generator=gen))
        num_pairs = int(torch.randint(1, 400, (1,), generator=gen))
        table = torch.randperm(6144, generator=gen)[:experts]  # each expert's slot in a large cache
        slots = table[torch.randint(0, experts, (num_pairs,), generator=gen)]
        blocks = padded_groups(slots, 6144, block_m) // block_m
        assert blocks <= grouped_gemm.max_blocks(num_pairs, 6144, block_m, groups=experts)


@interpreted
@pytest.mark.parametrize("num_pairs,num_slots,block_m", [(1, 1, 16), (15, 7, 4), (40, 3, 16), (300, 6144, 16)])
def test_alignment_groups_and_pads(num_pairs, num_slots, block_m):
    grouped_gemm = kernels()
    for seed in range(4):
        gen = torch.Generator().manual_seed(seed)
        slots = torch.randint(-2, num_slots + 2, (num_pairs,), generator=gen)
        in_kernel = grouped_gemm.align_by_slot(slots, num_slots, block_m, sort_in_kernel=True)
        host = grouped_gemm.align_by_slot(slots, num_slots, block_m, sort_in_kernel=False)
        assert torch.equal(in_kernel.sorted_pairs, host.sorted_pairs) and torch.equal(in_kernel.total, host.total)
        total = int(host.total)
        assert total == padded_groups(slots, num_slots, block_m)
        placed = host.sorted_pairs[:total]
        real = placed[placed < num_pairs].long()
        valid = (slots >= 0) & (slots < num_slots)
        assert sorted(real.tolist()) == torch.arange(num_pairs)[valid].tolist()
        for block in placed.view(-1, block_m):
            rows = block[block < num_pairs].long()
            assert len(rows) > 0 and block[0] < num_pairs  # a block's first row names its slot
            assert torch.all(slots[rows] == slots[rows[0]])


@interpreted
def test_alignment_under_a_bound_places_every_pair_as_without_it():
    """``groups``: the same placement in far fewer rows; a routing that names more distinct slots
    than promised loses the pairs past the rows, never writes past them."""
    grouped_gemm = kernels()
    gen = torch.Generator().manual_seed(0)
    table = torch.randperm(6144, generator=gen)[:12]
    slots = table[torch.randint(0, 12, (300,), generator=gen)]
    free = grouped_gemm.align_by_slot(slots, 6144, 16)
    bound = grouped_gemm.align_by_slot(slots, 6144, 16, groups=12)
    total = int(free.total)
    assert bound.num_blocks == 12 + (300 - 12) // 16 < free.num_blocks
    assert int(bound.total) == total and torch.equal(bound.sorted_pairs[:total], free.sorted_pairs[:total])
    broken = grouped_gemm.align_by_slot(torch.arange(300), 6144, 16, groups=12)  # 300 slots, 12 promised
    assert broken.sorted_pairs.numel() == (12 + 288 // 16) * 16
    assert bool((broken.sorted_pairs <= 300).all())  # pair ids or the padding id, nothing past


# ==== parity, interpreted ====

CONFIGS = [  # (tokens, top_k, slots, hidden, inter, block_m, block_n, block_k)
    (1, 1, 4, 32, 16, 16, 32, 16),  # a single pair
    (1, 2, 4, 32, 16, 16, 32, 16),
    (6, 3, 5, 40, 24, 16, 32, 16),  # hidden and inter not multiples of the tiles
    (8, 4, 3, 48, 40, 16, 64, 32),
    (5, 2, 64, 33, 17, 32, 32, 16),  # more slots than pairs
]


@interpreted
@pytest.mark.parametrize("case", ["random", "duplicates", "one_slot", "zero_weights"])
@pytest.mark.parametrize("shape", CONFIGS, ids=lambda c: "T{}k{}N{}H{}I{}".format(*c[:5]))
def test_parity_interpreted(shape, case):
    num_tokens, top_k, num_slots, dim, inter, block_m, block_n, block_k = shape
    grouped_gemm = kernels()
    config = grouped_gemm.BlockConfig(block_m, block_n, block_k, 2, 4, 2)
    for seed in range(3):
        w13, w2 = make_banks(num_slots, dim, inter, seed=seed)
        hidden = torch.randn(num_tokens, dim, generator=torch.Generator().manual_seed(seed + 100))
        weights, slots = make_routing(case, num_tokens, top_k, num_slots, seed=seed)
        out = grouped_gemm.fused_grouped_swiglu(hidden, weights, slots, w13, w2, config)
        assert rel_err(out, grouped_swiglu_eager(hidden, weights, slots, w13, w2)) < 1e-4


@interpreted
def test_a_bound_on_distinct_slots_changes_no_output():
    """A layer's routing over a bank of many slots (a cache) names a few, one an expert: bounded by
    their count the GEMMs run on far fewer rows and compute the same outputs, bit for bit."""
    grouped_gemm = kernels()
    w13, w2 = make_banks(40, 32, 24)
    gen = torch.Generator().manual_seed(5)
    table = torch.randperm(40, generator=gen)[:5]  # five experts' slots
    slots = table[torch.randint(0, 5, (20, 2), generator=gen)]
    hidden, weights = torch.randn(20, 32, generator=gen), torch.rand(20, 2, generator=gen)
    config = grouped_gemm.BlockConfig(16, 32, 16, 2, 4, 2)
    free = grouped_gemm.fused_grouped_swiglu(hidden, weights, slots, w13, w2, config)
    bound = grouped_gemm.fused_grouped_swiglu(hidden, weights, slots, w13, w2, config, groups=5)
    assert torch.equal(bound, free) and rel_err(bound, grouped_swiglu_eager(hidden, weights, slots, w13, w2)) < 1e-4


@interpreted
def test_out_of_range_slots_contribute_zero():
    num_slots = 4
    w13, w2 = make_banks(num_slots, 32, 16)
    hidden = torch.randn(5, 32)
    weights, slots = make_routing("random", 5, 3, num_slots)
    bad = torch.tensor([[True, False, False], [False, True, False], [False] * 3, [True, True, True], [False, False, True]])
    slots_bad = slots.clone()
    slots_bad[bad] = torch.tensor([-1, num_slots, num_slots + 7, -5, 2**40, 1 << 33])[: int(bad.sum())]
    out = grouped_swiglu(hidden, weights, slots_bad, w13, w2, backend="triton")
    ref = grouped_swiglu_eager(hidden, weights.masked_fill(bad, 0.0), slots.masked_fill(bad, 0), w13, w2)
    assert rel_err(out, ref) < 1e-4
    assert torch.all(out[3] == 0)


@interpreted
def test_public_op_forced_triton_matches_eager():
    w13, w2 = make_banks(6, 48, 32)
    hidden = torch.randn(4, 48)
    weights, slots = make_routing("random", 4, 2, 6)
    out = grouped_swiglu(hidden, weights, slots.int(), w13, w2, backend="triton")
    assert rel_err(out, grouped_swiglu(hidden, weights, slots, w13, w2)) < 1e-4


# ==== host checks ====

@pytest.mark.parametrize("bad", ["hidden_dim", "k_mismatch", "w13_shape", "w2_shape", "dtype", "slot_dtype", "device"])
def test_inconsistent_arguments_raise(bad):
    w13, w2 = make_banks(4, 16, 8)
    hidden = torch.randn(3, 16)
    weights, slots = make_routing("random", 3, 2, 4)
    args = dict(hidden=hidden, weights=weights, slots=slots, w13=w13, w2=w2)
    if bad == "hidden_dim":
        args["hidden"] = torch.randn(3, 15)
    elif bad == "k_mismatch":
        args["weights"] = torch.rand(3, 3)
    elif bad == "w13_shape":
        args["w13"] = torch.randn(4, 15, 16)
    elif bad == "w2_shape":
        args["w2"] = torch.randn(5, 16, 8)
    elif bad == "dtype":
        args["w2"] = w2.half()
    elif bad == "slot_dtype":
        args["slots"] = slots.float()
    else:
        args["w2"] = w2.to("meta")
    with pytest.raises(ValueError):
        grouped_swiglu(**args)


# ==== GPU ====

@pytest.mark.cuda
@pytest.mark.parametrize("num_slots,dim,inter", [(8, 2048, 768), (512, 1024, 384)])
@pytest.mark.parametrize("num_tokens", [1, 8, 64, 2048])
def test_bf16_parity_sync_free(num_tokens, num_slots, dim, inter):
    w13, w2 = make_banks(num_slots, dim, inter, torch.bfloat16, "cuda")
    for seed, case in enumerate(["random", "duplicates", "one_slot", "zero_weights"]):
        hidden = torch.randn(num_tokens, dim, device="cuda", generator=torch.Generator("cuda").manual_seed(seed)).bfloat16()
        weights, slots = make_routing(case, num_tokens, 8, num_slots, "cuda", seed)
        ref = grouped_swiglu_eager(hidden, weights, slots, w13, w2)
        grouped_swiglu(hidden, weights, slots, w13, w2)  # compile outside the sync check
        torch.cuda.set_sync_debug_mode("error")
        try:
            out = grouped_swiglu(hidden, weights, slots, w13, w2)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert rel_err(out, ref) < 2e-2, case


@pytest.mark.cuda
def test_cuda_out_of_range_slots_contribute_zero():
    w13, w2 = make_banks(16, 256, 128, torch.bfloat16, "cuda")
    hidden = torch.randn(8, 256, device="cuda").bfloat16()
    weights, slots = make_routing("random", 8, 4, 16, "cuda")
    bad = torch.rand(8, 4, device="cuda") < 0.3
    out = grouped_swiglu(hidden, weights, slots.masked_fill(bad, -1).masked_fill(bad.roll(1, 0), 16), w13, w2)
    bad = bad | bad.roll(1, 0)
    ref = grouped_swiglu_eager(hidden, weights.masked_fill(bad, 0.0), slots.masked_fill(bad, 0), w13, w2)
    assert rel_err(out, ref) < 2e-2


@pytest.mark.cuda
@pytest.mark.parametrize("num_pairs,num_slots", [(8, 6144), (512, 6144), (4000, 512), (16384, 128)])
def test_cuda_alignment_modes_agree(num_pairs, num_slots):
    grouped_gemm = kernels()
    slots = torch.randint(-1, num_slots + 1, (num_pairs,), device="cuda")
    host = grouped_gemm.align_by_slot(slots, num_slots, 16, sort_in_kernel=False)
    if num_pairs <= grouped_gemm.IN_KERNEL_SORT_MAX:
        in_kernel = grouped_gemm.align_by_slot(slots, num_slots, 16, sort_in_kernel=True)
        assert torch.equal(in_kernel.sorted_pairs, host.sorted_pairs)
    assert int(host.total) == padded_groups(slots, num_slots, 16)
    placed = host.sorted_pairs[: int(host.total)]
    assert torch.equal(placed[placed < num_pairs].sort().values.long(),
                       torch.arange(num_pairs, device="cuda")[(slots >= 0) & (slots < num_slots)])


@pytest.mark.cuda
@pytest.mark.parametrize("num_tokens", [1, 64])
def test_cuda_graph_replay_with_new_routing(num_tokens, capture_graph):
    w13, w2 = make_banks(64, 512, 256, torch.bfloat16, "cuda")
    hidden = torch.randn(num_tokens, 512, device="cuda").bfloat16()
    weights, slots = make_routing("random", num_tokens, 8, 64, "cuda", seed=0)
    graph, out = capture_graph(lambda: grouped_swiglu(hidden, weights, slots, w13, w2))
    for seed, case in enumerate(["random", "one_slot", "duplicates", "zero_weights"], start=1):
        new_weights, new_slots = make_routing(case, num_tokens, 8, 64, "cuda", seed)
        hidden.copy_(torch.randn_like(hidden))
        weights.copy_(new_weights)
        slots.copy_(new_slots)
        graph.replay()
        assert rel_err(out, grouped_swiglu_eager(hidden, weights, slots, w13, w2)) < 2e-2, case
