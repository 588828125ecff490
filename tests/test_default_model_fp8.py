"""The default model (a bf16 checkpoint) run with ``--expert-dtype fp8``: its experts quantized
128x128 while the expert store is filled, behind a 25% cache.

Its logits equal those of the float model run on the dequantized experts (the offload path adds no
error of its own). Against the bf16
experts the logits move by what e4m3 costs this model: measured 7-9% (relative L2 of the last
token's logits) on SmolLM2-135M's 30 layers, whose weights quantize with 2.7% relative error; one
scale per 1x128 or per row gave 6% and 7%, so no block size reaches 2e-2 on this model. With
128x128 blocks the offline entry point no longer answers the Paris prompt (a strict xfail below).
"""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moe_offload.expert_store import remove_segment
from moe_offload.experts import ExpertBanks
from moe_offload.fp8 import FP8_DTYPE, dequantize, dequantize_w13, quantize, quantize_w13
from worker.batch import SequenceChunk
from worker.expert_placement import ExpertOptions
from worker.runner import ModelRunner, RunnerConfig
from scheduler.messages.to_scheduler import SamplingParams
from frontend.tokenizer import ChatTokenizer

GENERATE = str(Path(__file__).resolve().parents[1] / "scripts" / "generate.py")

PROMPTS = ["What is the capital of France?", "Write a haiku about rivers.", "def fibonacci(n):"]


def last_logits(runner: ModelRunner, ids: list[int]) -> torch.Tensor:
    pages = runner.kv_pool.allocate(runner.kv_pool.pages_for(len(ids)))
    try:
        return runner.forward([SequenceChunk(ids, 0, pages)], [SamplingParams()], [0]).logits[0].float()
    finally:
        runner.kv_pool.free(pages)


def quantized_and_back(banks: ExpertBanks, fmt, dtype: torch.dtype) -> ExpertBanks:
    """The float banks that fp8 ``fmt`` keeps of ``banks``: quantized, then expanded again."""
    (q13, s13), (q2, s2) = quantize_w13(banks.w13, fmt.scale_block), quantize(banks.w2, fmt.scale_block)
    return ExpertBanks(dequantize_w13(q13, s13, fmt.scale_block, dtype), dequantize(q2, s2, fmt.scale_block, dtype))


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).norm() / want.norm()).item()


def compare(device: str, dtype: str, same_math_tol: float) -> None:
    from worker.default_model import default_model_dir

    model = str(default_model_dir())
    tok = ChatTokenizer.from_dir(model)
    config = RunnerConfig(model, device=device, dtype=dtype, kv_tokens=2048)
    bf16 = ModelRunner(config)
    fp8 = ModelRunner(RunnerConfig(**{**config.__dict__,
                                      "experts": ExpertOptions(cache_fraction=0.25, expert_dtype="fp8")}))
    dequantized = ModelRunner(config)  # the float model on the experts fp8 keeps: quantized, then expanded back
    dequantized.experts.banks = quantized_and_back(bf16.experts.banks, fp8.expert_format, bf16.dtype)
    try:
        assert fp8.experts.cache.w13.dtype == FP8_DTYPE and "fp8-b128x128" in fp8.experts.store.identity.label
        for prompt in PROMPTS:
            ids = tok.encode_chat([{"role": "user", "content": prompt}])
            got = last_logits(fp8, ids)
            assert relative(got, last_logits(dequantized, ids)) < same_math_tol, prompt
            assert 0.01 < relative(got, last_logits(bf16, ids)) < 0.12, prompt  # e4m3's cost, see the docstring
    finally:
        with contextlib.suppress(FileNotFoundError):  # another test session sharing /dev/shm may have removed it
            remove_segment(fp8.experts.store.name)


@pytest.mark.slow
def test_default_model_fp8_experts_equal_their_dequantized_twin_cpu():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a 135M model gains nothing from more; shared CI cores spin otherwise
    try:
        compare("cpu", "float32", 1e-4)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.cuda
def test_default_model_fp8_experts_equal_their_dequantized_twin_gpu(default_model_package):
    """Needs the Triton fp8 grouped GEMM (fp8-kernel)."""
    compare("cuda", "bfloat16", 2e-2)


@pytest.mark.slow
@pytest.mark.xfail(strict=True, reason="128x128 blocks are too coarse for SmolLM2-135M: greedy answers "
                                       "\"L'Étoile, la Marseur\"; 1x128, 32x32 and per-row scales answer Paris")
def test_default_model_in_fp8_knows_the_capital_of_france():
    from worker.default_model import default_model_dir

    proc = subprocess.run([sys.executable, GENERATE, "--model", str(default_model_dir()), "--chat",
                           "--prompt", "What is the capital of France?", "--max-tokens", "16", "--device", "cpu",
                           "--expert-dtype", "fp8", "--moe-cache-fraction", "0.25"],
                          capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout
