"""Expert records (``moe_offload.expert_records``): the store's and the cache's banks as strided views
into one record an expert. The views hold what the banks hold; a run of experts is found as one
range of records on both sides (and not where a side is banks of its own); the gather and the stage
kernel read and write records, banks of their own, or one of each, byte for byte as their twins;
the prefill pipeline from record banks equals resident and stages a run of misses in one copy."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from moe_offload.expert_records import RECORD_ALIGN, allocate, whole_records, record_layout, records_of  # noqa: E402
from moe_offload.experts import ExpertBanks, ResidentExperts  # noqa: E402
from moe_offload.kernels import gather_missing as gather_mod  # noqa: E402
from moe_offload.kernels import stage_experts as stage_mod  # noqa: E402
from moe_offload.offloaded import OffloadedExperts  # noqa: E402
from tests.launch_count import count_launches  # noqa: E402
from tests.record_banks import as_records  # noqa: E402
from tests.test_cache_kernels import GATHER_SHAPES, interpreted, random_gather, scale_banks  # noqa: E402
from tests.test_expert_cache import make_banks  # noqa: E402
from tests.test_prefill_pipeline import (  # noqa: E402
    EXPERTS, LAYERS, PREFILL, batches, cuda_rounds_match, lent_slots_are_empty)


def test_layout_aligns_every_bank_and_overlaps_none():
    layout = record_layout([5, 300, 1, 256])
    assert layout.offsets == (0, RECORD_ALIGN, 3 * RECORD_ALIGN, 4 * RECORD_ALIGN)
    assert layout.record_bytes == 5 * RECORD_ALIGN


def test_views_are_the_records_and_are_found_again():
    specs = [((6, 8), torch.bfloat16), ((8, 3), torch.uint8), ((6, 1), torch.float32)]
    records, banks = allocate(5, specs, "cpu")
    for i, bank in enumerate(banks):
        bank.copy_(torch.full(bank.shape, i + 1, dtype=bank.dtype))
    layout = record_layout([6 * 8 * 2, 8 * 3, 6 * 4])
    assert records.shape == (5, layout.record_bytes)
    assert torch.equal(records[3, layout.offsets[1]:layout.offsets[1] + 24], torch.full((24,), 2, dtype=torch.uint8))
    found, offsets = records_of(banks)
    assert found.data_ptr() == records.data_ptr() and found.shape == records.shape and offsets == layout.offsets
    assert records_of([b[1:4] for b in banks])[0].shape == (3, layout.record_bytes)  # a buffer of the pool
    assert records_of([b.clone() for b in banks]) is None  # banks of their own
    assert records_of([banks[0], banks[1][:4]]) is None  # not the same experts
    assert records_of(banks[1:]) is None and records_of(banks[:2]) is None  # a part of the record
    assert records_of([b[:4] for b in banks[1:]]) is None  # a part, with records after it to run into
    assert records_of([banks[1], banks[0], banks[2]]) is None  # not in the record's order
    other = allocate(3, specs, "cpu")[1]
    (host, pool), = whole_records(list(zip([b[:3] for b in banks], other)))  # one pair of whole records
    assert host.shape == pool.shape == (3, layout.record_bytes) and host.data_ptr() == records.data_ptr()
    own = list(zip([b[:3].clone() for b in banks], other))
    assert whole_records(own) == own  # not records on one side: the banks as given
    shorter = allocate(3, specs[:2], "cpu")[1]  # another layout: the offsets agree, the records do not
    mixed = list(zip([b[:3] for b in banks[:2]], shorter))
    assert whole_records(mixed) == mixed


@interpreted
@pytest.mark.parametrize("programs", [0, 2])
@pytest.mark.parametrize("layout", ["records", "host-records", "slot-records"])
def test_gather_moves_records_byte_for_byte(layout, programs):
    """Plans of every shape over w13, w2 and two scale banks, with either side or both as records:
    one launch, each bank's planned rows equal to the twin's over banks of their own."""
    kernel = "triton.gather_missing_few_kernel" if programs else "triton.gather_missing_kernel"
    for trial in range(8):
        gen = torch.Generator().manual_seed(trial)
        plan, host, slots = random_gather(GATHER_SHAPES[trial % len(GATHER_SHAPES)], gen)
        host = [*host, *scale_banks(2, host[0].shape[0], gen)]
        slots = [*slots, *(t[:slots[0].shape[0]].clone() for t in scale_banks(2, host[0].shape[0], gen))]
        want = [t.clone() for t in slots]
        gather_mod.gather_missing(*plan, *host[:2], *want[:2], backend="eager", host_scales=host[2:],
                                  slot_scales=want[2:])
        src = as_records(host) if layout != "slot-records" else host
        got = as_records(slots) if layout != "host-records" else [t.clone() for t in slots]
        with count_launches() as launches:
            gather_mod.gather_missing(*plan, *src[:2], *got[:2], backend="triton", host_scales=src[2:],
                                      slot_scales=got[2:], programs=programs)
        assert dict(launches.launches) == {kernel: 1}
        for a, b in zip(got, want):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), trial


@interpreted
@pytest.mark.parametrize("layout", ["records", "host-banks"])
def test_stage_kernel_stages_records_as_its_twin(layout):
    """A layer staged from a record pool (hits) and record or plain host banks (misses) into a
    record buffer: the kernel equals the twin, with one launch where every side is records."""
    gen = torch.Generator().manual_seed(1)
    layers, experts, slots, lent = 3, 6, 20, 12
    host = [torch.randn(layers * experts, 5, 7, generator=gen), torch.randn(layers * experts, 7, 5, generator=gen),
            torch.randn(layers * experts, 2, 3, generator=gen)]
    pools = as_records([torch.randn(slots, *h.shape[1:], generator=gen) for h in host])
    host = as_records(host) if layout == "records" else host
    slot_for_id = torch.full((layers * experts,), -1, dtype=torch.int32)
    resident = torch.randperm(layers * experts, generator=gen)[:slots]
    slot_for_id[resident] = torch.randperm(slots, generator=gen)[:len(resident)].int()  # lent-range ones miss
    outs = []
    for backend in ("triton", "eager"):
        pool = as_records([t.clone() for t in pools])
        stats = torch.zeros(layers, 2, dtype=torch.int64)
        scales = [(pool[2], host[2], pool[2][6:12])]
        with count_launches() as launches:
            stage_mod.stage_experts(1, experts, lent, slot_for_id, *pool[:2], *host[:2], pool[0][6:12], pool[1][6:12],
                                    stats, backend=backend, programs=4, scales=scales)
        outs.append((pool, stats, sum(launches.launches.values())))
    (got, got_stats, launched), (want, want_stats, _) = outs
    assert all(torch.equal(a, b) for a, b in zip(got, want)) and torch.equal(got_stats, want_stats)
    assert launched == (1 if layout == "records" else 3)


def record_banks(banks: ExpertBanks, pin: bool = False) -> ExpertBanks:
    """``banks`` as the store holds them: ``[L, E, ...]`` views into one record an expert."""
    views = as_records([t.flatten(0, 1) for t in banks.tensors()], pin)
    return banks._replace(**{name: v.view(t.shape) for name, t, v in zip(("w13", "w2"), banks.tensors(), views)})


@pytest.mark.parametrize("stage", ["kernel", "memcpy", "misses", "mirror"])
def test_pipeline_from_records_equals_resident_and_copies_a_run_at_once(stage):
    """Host banks in records (as the store's) and the cache's record slots: every stage mode gives
    the resident results and leaves the lent slots empty; the mirror copies a run of misses in one
    copy, "memcpy" a layer in one."""
    plain = make_banks(LAYERS, EXPERTS, 16, 8)
    banks = record_banks(plain)
    assert records_of([t.flatten(0, 1) for t in banks.tensors()]) is not None
    offloaded = OffloadedExperts.create(banks, 3 * EXPERTS, "cpu", "lfru", pipeline=True, stage=stage)
    resident = ResidentExperts(plain)
    pipeline = offloaded.pipeline
    assert [len(pairs) for pairs in pipeline.layer_copies] == [1, 1]
    if pipeline.mirrored is not None:
        assert pipeline.mirrored.copies_per_run == 1
    for step in batches(0, rounds=3):
        copies = pipeline.mirrored.copies if pipeline.mirrored is not None else 0
        for layer, (x, weights, ids) in enumerate(step):
            want = resident.forward(layer, x, weights, ids)
            torch.testing.assert_close(offloaded.forward(layer, x, weights, ids), want, rtol=1e-5, atol=1e-5)
        if len(step[0][0]) == PREFILL:
            assert lent_slots_are_empty(offloaded.cache)
            if stage == "mirror":  # the chunk's copies: one a run of missed experts
                assert pipeline.mirrored.copies - copies == sum(len(runs) for runs in pipeline.mirrored.runs) > 0
    assert pipeline.stats()[f"chunks_{stage}"] == 3


@pytest.mark.cuda
@pytest.mark.parametrize("stage", ["kernel", "memcpy", "mirror"])
def test_cuda_pipeline_from_pinned_records_matches_resident_without_sync(stage):
    """bf16 experts in pinned records (as the registered store's) staged into the cache's record
    slots: each stage mode equals resident experts under sync-debug mode, the mirror one copy a run."""
    plain = make_banks(LAYERS, 16, 128, 64)
    plain = ExpertBanks(plain.w13.bfloat16(), plain.w2.bfloat16())
    piped = OffloadedExperts.create(record_banks(plain, pin=True), 48, "cuda", pipeline=True, stage=stage)
    assert [len(pairs) for pairs in piped.pipeline.layer_copies] == [1, 1]
    cuda_rounds_match(piped, ResidentExperts(plain.to("cuda")))
    stats = piped.pipeline.stats()
    assert stats[f"chunks_{stage}"] == 6 and stats["from_host"] > 0
    if stage == "mirror":
        assert piped.pipeline.mirrored.copies_per_run == 1


@pytest.mark.parametrize("model", ["qwen3-30b-geometry", "qwen3.5-35b-a3b-geometry", "gpt-oss-120b-geometry"])
def test_a_record_pads_an_expert_by_a_few_hundred_bytes(model):
    """The alignment's padding on the real geometries, which ``slot_bytes`` (an expert's own bytes,
    the memory plan's and the bounds' unit) leaves out: 128 B on qwen3-30b fp8, 308 B on gpt-oss
    fp8 (of 4.7 and 24.9 MB), none in bf16 or nvfp4."""
    import math

    from moe_offload.formats import bank_specs, resolve_expert_format
    from moe_offload.formats.expert_format import ExpertFormat
    from worker.config import ModelConfig
    from worker.expert_placement import expert_slot_bytes

    cfg = ModelConfig.from_dir(model)
    padding = {}
    for name in ("bf16", "fp8", "nvfp4", "mxfp4"):
        fmt = resolve_expert_format(name, ExpertFormat(torch.bfloat16), torch.bfloat16)
        rows = [math.prod(shape) * dtype.itemsize
                for shape, dtype in bank_specs(fmt, cfg.expert_intermediate_size, cfg.hidden_size).values()]
        assert sum(rows) == expert_slot_bytes(cfg, fmt)
        padding[name] = record_layout(rows).record_bytes - sum(rows)
    want = {"qwen3-30b-geometry": {"bf16": 0, "fp8": 128, "nvfp4": 0, "mxfp4": 0},
            "qwen3.5-35b-a3b-geometry": {"bf16": 0, "fp8": 0, "nvfp4": 0, "mxfp4": 0},
            "gpt-oss-120b-geometry": {"bf16": 0, "fp8": 308, "nvfp4": 0, "mxfp4": 128}}[model]
    assert padding == want
