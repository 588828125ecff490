"""What Triton would compile does not follow the batch (issue 32), checked on a CPU.

Triton compiles a kernel once per combination of its int arguments' ``== 1`` and divisibility by
16 and of its pointers' 16-byte alignment, unless a kernel names them in ``do_not_specialize`` /
``do_not_specialize_on_alignment``. Here every launch of a tiny model's steps is intercepted under
Triton's interpreter (the kernels do not run: only their arguments matter) and its key is computed
as Triton computes it for a GPU; after reference steps, prefill chunks of other lengths over cached
prefixes of other lengths, and decode steps of other batch sizes, must add no key to any kernel.
The lengths stay within one entry of the grouped GEMM's tile tables and of the align kernel's
in-register sort: constexprs chosen by the token count on purpose, which the warm-up has to meet
once each. The GPU test that the served steps compile nothing after the warm-up is
``test_no_recompile``.
"""
from __future__ import annotations

import inspect
import json
import random

import pytest
import torch

from scheduler.messages.to_scheduler import SamplingParams
from tests.tiny_models import write_tiny
from worker.batch import SequenceChunk
from worker.runner import ModelRunner, RunnerConfig
from worker.runner_config import ExpertOptions
from worker.token_mask import TokenMask, mask_words

interpreter = pytest.importorskip("triton.runtime.interpreter")
libtriton = pytest.importorskip("triton._C.libtriton")
if not hasattr(libtriton, "native_specialize_impl"):
    pytest.skip("this Triton computes its keys otherwise", allow_module_level=True)
from triton.backends.compiler import BaseBackend  # noqa: E402

GREEDY, SAMPLED = SamplingParams(), SamplingParams(temperature=0.7, top_k=20, top_p=0.9, seed=0)
EXPERTS = 8


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-keys")
    write_tiny(path, "qwen3_moe", seed=5, layers=4, hidden=128, heads=4, kv_heads=2, head_dim=64, experts=EXPERTS,
               top_k=2, inter=64, vocab=256)
    config = path / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "max_position_embeddings": 8192}))
    return str(path)


@pytest.fixture
def keys(monkeypatch):
    """``{kernel: {key: phase}}`` of every launch from now on, under the interpreter, none of them run;
    ``keys["phase"]`` names the phase new keys are recorded in."""
    from moe_offload.kernels.triton_support import interpreting

    if not interpreting():
        pytest.skip("intercepts the launches of Triton's interpreter (TRITON_INTERPRET=1: CPU machines)")
    monkeypatch.setenv("SLUICE_KERNELS", "triton")
    seen: dict = {"phase": "reference"}

    def run(self, *args, grid, warmup, **kwargs):
        kernel = seen.setdefault(f"{self.fn.__module__}.{self.fn.__name__}", {})
        kernel.setdefault(launch_key(self, args, kwargs), seen["phase"])

    monkeypatch.setattr(interpreter.InterpretedFunction, "run", run)
    return seen


def launch_key(kernel, args: tuple, kwargs: dict) -> tuple:
    """The specialisation of a launch as a GPU's Triton would key it: each argument's type and
    properties (``native_specialize_impl`` with the kernel's lists), the constexprs, the options."""
    params = list(inspect.signature(kernel.fn).parameters.values())
    names = {p.name for p in params}
    values = {**dict(zip([p.name for p in params], args)), **kwargs}
    loose = set(kernel.kwargs.get("do_not_specialize") or ())
    unaligned = set(kernel.kwargs.get("do_not_specialize_on_alignment") or ())
    key = []
    for i, p in enumerate(params):
        value = values.get(p.name, p.default)
        if "constexpr" in str(p.annotation):
            key.append((p.name, repr(value)))
        else:
            spec = libtriton.native_specialize_impl(BaseBackend, value, False, not {p.name, i} & loose,
                                                    not {p.name, i} & unaligned)
            key.append((p.name, spec[0], spec[1]))
    return tuple(key), tuple(sorted((k, repr(v)) for k, v in kwargs.items() if k not in names))


@pytest.mark.parametrize("expert_dtype", ["bf16", "fp8"])
def test_no_launch_key_follows_the_batch(model_dir, keys, expert_dtype):
    runner = ModelRunner(RunnerConfig(model_dir, device="cpu", dtype="bfloat16", page_size=16, kv_tokens=16384,
                                      attention="triton", max_prefill_tokens=2048,
                                      experts=ExpertOptions(cache_size=3 * EXPERTS, expert_dtype=expert_dtype,
                                                            prefill_stage="kernel")))
    rng = random.Random(1)
    # chunks of more than 512 tokens (one tile of every table), from 0 and over a cached prefix, sampled
    # under a mask and greedy
    prefill(runner, rng, 1024, 0, SAMPLED, masked=True)
    prefill(runner, rng, 1024, 1024, GREEDY, masked=False)
    for batch in (65, 66):  # eager decode (past the graphs' buckets), 65 to 128 tokens: one tile too
        decode(runner, rng, batch)
    keys["phase"] = "later"
    for length, prefix in ((600, 0), (777, 1), (2047, 17), (513, 3001), (2048, 2048), (1001, 4000), (999, 333)):
        prefill(runner, rng, length, prefix, rng.choice((GREEDY, SAMPLED)), rng.random() < 0.5)
    for batch in (67, 77, 97, 128):
        decode(runner, rng, batch)
    later = {kernel: [k for k, phase in found.items() if phase == "later"] for kernel, found in keys.items()
             if kernel != "phase"}
    assert {kernel: differences(keys[kernel], new) for kernel, new in later.items() if new} == {}
    assert any("prefill_kernel" in k for k in keys) and any("decode_rope_partial" in k for k in keys)


def test_the_mirrors_repair_gather_compiles_at_start_up(model_dir, keys):
    """Prefill from the mirror repairs with one gather a layer over views of per-layer rows; they
    keep one alignment, so the launch at construction (before the warm-up ends) is the only
    specialisation that chunks meet, whichever layers and lengths."""
    runner = ModelRunner(RunnerConfig(model_dir, device="cpu", dtype="bfloat16", page_size=16, kv_tokens=16384,
                                      attention="triton", max_prefill_tokens=2048,
                                      experts=ExpertOptions(cache_size=3 * EXPERTS, prefill_stage="mirror")))
    assert runner.experts.pipeline.mirrored is not None
    gather = "moe_offload.kernels.gather_missing.gather_missing_kernel"
    assert len(keys[gather]) == 1  # the construction's launch
    keys["phase"] = "later"
    rng = random.Random(2)
    for length, prefix in ((1024, 0), (777, 1024), (2047, 17)):
        prefill(runner, rng, length, prefix, GREEDY, masked=False)
    assert runner.experts.pipeline.stats()["chunks_mirror"] == 3
    assert list(keys[gather].values()) == ["reference"]


def differences(found: dict, new: list) -> list:
    """For each new key, the arguments in which it differs from the nearest reference key."""
    reference = [k for k, phase in found.items() if phase == "reference"]
    out = []
    for key in new:
        near = min(reference, key=lambda r: sum(a != b for a, b in zip(r[0], key[0])), default=((), ()))
        out.append([b for a, b in zip(near[0], key[0]) if a != b] + ([key[1]] if near[1] != key[1] else []))
    return out


def prefill(runner: ModelRunner, rng: random.Random, length: int, prefix: int, sampling: SamplingParams,
            masked: bool) -> None:
    """One chunk of ``length`` tokens over ``prefix`` cached ones (the cache's contents do not
    matter: nothing runs)."""
    pages = list(range(1, 1 + runner.kv_pool.pages_for(prefix + length)))
    mask = TokenMask(allow_all(runner, 1), [0]) if masked else None
    runner.forward([SequenceChunk([rng.randrange(1, 200) for _ in range(length)], prefix, pages)], [sampling], [0],
                   mask=mask)


def decode(runner: ModelRunner, rng: random.Random, batch: int) -> None:
    """A decode step of ``batch`` sequences of random lengths on pages of their own, sampled and
    greedy, some rows under a grammar's mask."""
    chunks, first = [], 1
    for _ in range(batch):
        length = rng.randrange(1, 100)
        n = runner.kv_pool.pages_for(length + 1)
        chunks.append(SequenceChunk([rng.randrange(1, 200)], length, list(range(first, first + n))))
        first += n
    sampling = [SAMPLED] + [rng.choice((GREEDY, SAMPLED)) for _ in range(batch - 1)]
    mask = TokenMask(allow_all(runner, 2), [rng.choice((-1, 0, 1)) for _ in range(batch)])
    runner.forward(chunks, sampling, [rng.randrange(100) for _ in range(batch)], mask=mask)


def allow_all(runner: ModelRunner, rows: int) -> torch.Tensor:
    return torch.full((rows, mask_words(runner.model_config.vocab_size)), -1, dtype=torch.int32)
