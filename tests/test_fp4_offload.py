"""4-bit experts through the whole offload path: the dummy store quantized at fill (nvfp4, mxfp4),
the cache's slot pools sized by every bank's bytes, the prefill pipeline's staging and decode's
gathers moving packed weights and scales as bytes; offloaded against the same experts resident.
On a GPU: the W4A16 kernels, no hidden sync in a prefill chunk or a decode step, CUDA graphs."""
from __future__ import annotations

import pytest
import torch

from moe_offload.formats import MXFP4, NVFP4
from scheduler.generate import generate
from scheduler.messages.to_scheduler import SamplingParams
from tests.test_fp8_offload import check_sync_free_offload_near_resident, prefill_then_decode
from worker.expert_placement import ExpertOptions
from worker.runner import ModelRunner, RunnerConfig

FORMATS = [NVFP4, MXFP4]


def small(device: str, fmt, **options) -> ModelRunner:
    dtype, graphs = ("bfloat16", options.pop("cuda_graph", False)) if device == "cuda" else ("float32", False)
    return ModelRunner(RunnerConfig("small-geometry", device=device, dtype=dtype, page_size=16, kv_tokens=4096,
                                    max_prefill_tokens=512, cuda_graph=graphs,
                                    experts=ExpertOptions(dummy_weights=True, expert_dtype=fmt.name, **options)))


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_4bit_small_geometry_offloaded_equals_resident_on_cpu(fmt):
    r, resident = small("cpu", fmt, cache_fraction=0.25), small("cpu", fmt)
    cache = r.experts.cache
    assert r.experts.pipeline is not None and cache.format == fmt == resident.experts.banks.format
    assert cache.num_slots == 48 and cache.w13.dtype == torch.uint8 and cache.w13.shape[-1] == 128 // 2
    assert cache.slot_bytes == sum(t[0].nbytes for t in (cache.w13, cache.w2, *cache.scales.tensors()))
    prompt = torch.randint(0, 512, (700,), generator=torch.Generator().manual_seed(0)).tolist()
    got, want = prefill_then_decode(r, prompt, 512, 3), prefill_then_decode(resident, prompt, 512, 3)
    assert ((got - want).norm() / want.norm()).item() < 1e-5
    assert r.experts.pipeline.stats()["from_host"] > 0 and r.experts.cache.stats()["total"]["misses"] > 0


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_4bit_dummy_store_is_random_codes_under_a_drawn_scale(fmt, tmp_path):
    """The fast 4-bit dummy fill: seeded (same seed, same bytes; another seed, other codes), each
    matrix's own codes, the values' spread about the float draw's 0.02, the scales of one draw."""
    from moe_offload.formats import dequantize_w13
    from moe_offload.store_fill import open_dummy_experts
    from worker.config import ModelConfig
    from worker.expert_placement import expert_geometry

    geometry = expert_geometry(ModelConfig.from_dir("small-geometry"))
    for name in ("0", "1", "other"):
        (tmp_path / name).mkdir()
    one, two = (open_dummy_experts(geometry, 3, fmt, tmp_path / name).host_banks() for name in ("0", "1"))
    other = open_dummy_experts(geometry, 4, fmt, tmp_path / "other").host_banks()
    assert all(torch.equal(a, b) for a, b in zip(one.tensors(), two.tensors()))
    assert not torch.equal(one.w13[1, 2], other.w13[1, 2]) and not torch.equal(one.w13[1, 2], one.w13[1, 3])
    parts = [t[1, 2] for t in one.tensors()[0::2] if t is not None]  # w13 and its scale parts
    w13 = dequantize_w13(fmt, tuple(parts), torch.float32)
    assert 0.01 < w13.std().item() < 0.04 and abs(w13.mean().item()) < 2e-3


@pytest.mark.cuda
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_cuda_4bit_small_geometry_prefill_and_decode_without_sync(fmt):
    r, resident = small("cuda", fmt, cache_fraction=0.25), small("cuda", fmt)
    assert r.experts.pipeline is not None and r.experts.cache.format == fmt
    check_sync_free_offload_near_resident(r, resident)


@pytest.mark.cuda
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_cuda_4bit_decode_graphs_generate_as_resident(fmt):
    r = small("cuda", fmt, cache_fraction=0.25, cuda_graph=True)
    resident = small("cuda", fmt, cuda_graph=True)
    prompt = torch.randint(0, 512, (300,), generator=torch.Generator().manual_seed(1)).tolist()
    want = generate(resident, prompt, SamplingParams(), 24).token_ids
    assert generate(r, prompt, SamplingParams(), 24).token_ids == want
