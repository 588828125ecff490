"""The default model with 25% of its experts in the GPU cache (the rest in the expert store)
generates exactly what the fully resident model does: greedy, token for token."""
from __future__ import annotations

import pytest
import torch

from moe_offload.expert_store import remove_segment
from moe_offload.offloaded import OffloadedExperts
from worker.expert_placement import ExpertOptions
from scheduler.generate import generate
from worker.runner import ModelRunner, RunnerConfig
from scheduler.messages.to_scheduler import SamplingParams
from frontend.tokenizer import ChatTokenizer

PROMPTS = ["What is the capital of France?", "Write a haiku about rivers.", "List three prime numbers."]


def compare(device: str, dtype: str, max_tokens: int) -> None:
    from worker.default_model import default_model_dir

    model = str(default_model_dir())
    tok = ChatTokenizer.from_dir(model)
    config = RunnerConfig(model, device=device, dtype=dtype, kv_tokens=2048)
    resident = ModelRunner(config)
    offloaded = ModelRunner(RunnerConfig(**{**config.__dict__, "experts": ExpertOptions(cache_fraction=0.25)}))
    try:
        assert isinstance(offloaded.experts, OffloadedExperts)
        assert offloaded.experts.cache.num_slots == 60  # 25% of 30 layers x 8 experts
        for prompt in PROMPTS:
            ids = tok.encode_chat([{"role": "user", "content": prompt}])
            want = generate(resident, ids, SamplingParams(), max_tokens).token_ids
            assert generate(offloaded, ids, SamplingParams(), max_tokens).token_ids == want, prompt
        stats = offloaded.experts.cache.stats()["total"]  # decode lookups; prefill goes through the pipeline
        assert stats["misses"] > 0 and stats["hits"] + stats["misses"] == stats["lookups"]
    finally:
        remove_segment(offloaded.experts.store.name)


@pytest.mark.slow
def test_default_model_offloaded_equals_resident_cpu():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a 135M model gains nothing from more; shared CI cores spin otherwise
    try:
        compare("cpu", "float32", 16)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.cuda
def test_default_model_offloaded_equals_resident_gpu(default_model_package):
    compare("cuda", "bfloat16", 32)
