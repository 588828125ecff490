"""The HF parity checks of test_model_parity on a CUDA GPU: bfloat16 (relative error < 2e-2) and
float32 (< 1e-4) against the float32 reference.

Routing is a discrete choice: in bf16 a token whose k-th and (k+1)-th router scores nearly tie can
pick another expert than the fp32 reference, which moves its logits far more than rounding does.
The bf16 models therefore get a sharper router (std 1.0 instead of 0.3), bf16-representable
weights (the same function in both precisions) and smaller weights (std 0.04 instead of 0.08: on an H200
the 0.08 models put bf16 at 2-8% from the fp32 reference while the same code in fp32 matched to
1e-4, i.e. the models amplified rounding); fp32 keeps the CPU tests' models and must match them to
1e-4, which is what checks the GPU kernels."""
from __future__ import annotations

import pytest
import torch

from tests.test_model_parity import GREEDY, SHAPES, hf_logits, rel_err
from tests.tiny_models import write_tiny
from worker.batch import SequenceChunk
from worker.runner import ModelRunner, RunnerConfig

pytestmark = pytest.mark.cuda


TOLERANCE = {"bfloat16": 2e-2, "float32": 1e-4}


@pytest.fixture(params=[(s, d) for d in TOLERANCE for s in SHAPES],
                ids=lambda p: p[1] + "-" + "-".join(f"{v}" for v in p[0].values()))
def tiny_gpu(request, tmp_path):
    shape, dtype = request.param
    bf16 = dtype == "bfloat16"
    hf = write_tiny(tmp_path, **shape, router_std=1.0 if bf16 else 0.3, weight_std=0.04 if bf16 else 0.08,
                    bf16_weights=bf16)
    runner = ModelRunner(RunnerConfig(str(tmp_path), device="cuda", dtype=dtype, page_size=16, kv_tokens=1024))
    return hf, runner, TOLERANCE[dtype]


def test_bf16_prefill_and_decode_match_hf(tiny_gpu):
    hf, runner, tol = tiny_gpu
    pool = runner.kv_pool
    ids = torch.randint(0, 128, (70,), generator=torch.Generator().manual_seed(3)).tolist()
    ref = hf_logits(hf, ids)
    pages = pool.allocate(pool.pages_for(len(ids)))
    out = runner.forward([SequenceChunk(ids[:33], 0, pages)], [GREEDY], [0])
    assert rel_err(out.logits[0].cpu(), ref[32]) < tol
    out = runner.forward([SequenceChunk(ids[33:60], 33, pages)], [GREEDY], [0])
    assert rel_err(out.logits[0].cpu(), ref[59]) < tol
    for pos in range(60, 70):
        out = runner.forward([SequenceChunk([ids[pos]], pos, pages)], [GREEDY], [0])
        assert rel_err(out.logits[0].cpu(), ref[pos]) < tol


def test_bf16_batched_prefill_matches_hf(tiny_gpu):
    hf, runner, tol = tiny_gpu
    pool = runner.kv_pool
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 128, (n,), generator=gen).tolist() for n in (1, 17, 40)]
    chunks = [SequenceChunk(p, 0, pool.allocate(pool.pages_for(len(p)))) for p in prompts]
    out = runner.forward(chunks, [GREEDY] * 3, [0] * 3)
    for b, p in enumerate(prompts):
        assert rel_err(out.logits[b].cpu(), hf_logits(hf, p)[-1]) < tol
