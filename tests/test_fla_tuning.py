"""fla's tuned configs kept per GPU (worker/linear_attention/fla_tuning.py, scripts/fla_configs.py):
what a process's autotuners chose is written in fla's own file format, so that fla itself reads it
back in strict mode; dumps of several workers merge; the kept folder is used only where it exists
for this GPU and the user has not set fla's variables."""
from __future__ import annotations

import os
import sys
import types
from pathlib import Path

import pytest

cache = pytest.importorskip("fla.ops.utils.cache")  # fla-core: a dependency on Linux
triton = pytest.importorskip("triton")

from worker.linear_attention import fla_tuning  # noqa: E402
from worker.linear_attention.fla_tuning import dump, gpu_folder, read, use_kept_configs  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import fla_configs  # noqa: E402

KEY = (16, 32, 128, 128, 64, False, "torch.bfloat16", "torch.float32")
HASH = cache.AutotuneKey.key_hash(KEY)


@pytest.fixture
def fla_env(monkeypatch):
    """fla's variables unset (``use_kept_configs`` sets them: both put back after the test), and
    its mode too."""
    for name in ("FLA_CONFIG_DIR", "FLA_CACHE_MODE"):
        monkeypatch.setenv(name, "")  # recorded, so the teardown restores (or removes) it
        monkeypatch.delenv(name)
    monkeypatch.setattr(cache, "FLA_CACHE_MODE", cache.FlaCacheMode.DISABLED)
    return monkeypatch


def test_kept_configs_are_used_where_they_exist_and_the_user_set_nothing(tmp_path, fla_env):
    (tmp_path / gpu_folder("NVIDIA H200")).mkdir()
    assert gpu_folder("NVIDIA H100 80GB HBM3") == "NVIDIA_H100_80GB_HBM3"
    assert not use_kept_configs("NVIDIA H100 80GB HBM3", tmp_path)  # none kept for this GPU
    assert "FLA_CONFIG_DIR" not in os.environ and cache.FLA_CACHE_MODE is cache.FlaCacheMode.DISABLED
    assert use_kept_configs("NVIDIA H200", tmp_path)
    assert os.environ["FLA_CONFIG_DIR"] == str(tmp_path / "NVIDIA_H200") and os.environ["FLA_CACHE_MODE"] == "strict"
    assert cache.FLA_CACHE_MODE is cache.FlaCacheMode.STRICT  # fla read its mode at import: set there too


def test_the_users_own_fla_settings_win(tmp_path, fla_env):
    (tmp_path / gpu_folder("NVIDIA H200")).mkdir()
    fla_env.setenv("FLA_CACHE_MODE", "disabled")
    assert not use_kept_configs("NVIDIA H200", tmp_path)
    assert "FLA_CONFIG_DIR" not in os.environ and cache.FLA_CACHE_MODE is cache.FlaCacheMode.DISABLED


def test_fla_reads_back_what_was_dumped_in_strict_mode(tmp_path, fla_env):
    tuner = object.__new__(cache.CachedAutotuner)  # an autotuner that has tuned KEY (no kernel behind it)
    tuner.kernel_name, tuner.cache = "chunk_fake_kernel", {KEY: triton.Config({"BV": 32, "BK": 64}, num_warps=4,
                                                                               num_stages=3)}
    module = types.ModuleType("fla.ops.fake_kernels")
    module.chunk_fake_kernel = tuner
    fla_env.setitem(sys.modules, "fla.ops.fake_kernels", module)
    assert dump(tmp_path, {"chunk_fake_kernel": fla_tuning.tuned()["chunk_fake_kernel"]}) == 1
    fla_env.setenv("FLA_CONFIG_DIR", str(tmp_path))
    fla_env.setattr(cache, "FLA_CACHE_MODE", cache.FlaCacheMode.STRICT)
    got = cache.load_cached_config("chunk_fake_kernel", cache.AutotuneKey(KEY))
    assert got["kwargs"] == {"BV": 32, "BK": 64} and (got["num_warps"], got["num_stages"]) == (4, 3)
    other = (*KEY[:2], 64, *KEY[3:])  # another head dim: strict mode autotunes it, never reuses this one
    assert cache.load_cached_config("chunk_fake_kernel", cache.AutotuneKey(other)) is None


def test_workers_dumps_merge_and_the_later_choice_wins(tmp_path):
    def entry(warps):
        return {"autotune_key": list(KEY), "config": {"kwargs": {}, "num_warps": warps}}

    other = cache.AutotuneKey.key_hash((1, *KEY[1:]))
    dump(tmp_path / "dumps" / "gw0", {"k1": {HASH: entry(4)}, "k2": {other: entry(2)}})
    dump(tmp_path / "dumps" / "gw1", {"k1": {HASH: entry(8)}})
    count, target = fla_configs.merge([tmp_path / "dumps"], "NVIDIA H200", kept=tmp_path / "kept")
    assert target == tmp_path / "kept" / "NVIDIA_H200" and count == 2
    kept = read(target)
    assert kept["k1"][HASH]["config"]["num_warps"] == 8 and len(kept["k2"]) == 1


def test_tune_refuses_without_a_gpu_and_a_model_without_linear_layers(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        fla_configs.tune(["tiny-hybrid-geometry"], 64)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # refused before anything touches a GPU
    with pytest.raises(SystemExit, match="qwen3-30b-geometry has no linear-attention layers"):
        fla_configs.tune(["qwen3-30b-geometry"], 64)


def test_every_fla_tuner_becomes_one_that_reads_kept_configs():
    """In a fresh process (an earlier import elsewhere must not hide the change): after ``prepare``'s
    swap, no plain Triton autotuner is left in fla's modules, the chunked gated-delta kernels among
    those changed, each named as fla's own decorator names it."""
    import subprocess

    code = """
from worker.linear_attention import fla_tuning
changed = fla_tuning.cache_every_tuner()
from fla.ops.utils.cache import CachedAutotuner
tuners = fla_tuning._autotuners()
assert all(type(t) is CachedAutotuner for t in tuners)
names = {t.kernel_name for t in tuners}
from fla.ops.common import chunk_h
under_heuristics = chunk_h.chunk_fwd_kernel_h.fn
assert type(under_heuristics) is CachedAutotuner and under_heuristics.kernel_name == "chunk_fwd_kernel_h"
assert fla_tuning.cache_every_tuner() == 0  # once is enough
print(changed, len(names))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=Path(__file__).parents[1])
    assert out.returncode == 0, out.stderr[-2000:]
    changed, names = map(int, out.stdout.split()[-2:])  # fla 0.6: 142 changed (of 197 tuners)
    assert changed > 10 and names > 10


def test_prepare_says_when_fla_will_autotune(tmp_path, fla_env, monkeypatch, caplog):
    """No kept folder for this GPU: one line naming the card and the command that keeps configs;
    a kept one, or the user's own fla settings: silence."""
    monkeypatch.setattr(fla_tuning, "cache_every_tuner", lambda: 0)  # fla's tuners: the subprocess test's
    with caplog.at_level("INFO", logger="sluice.worker"):
        assert not fla_tuning.prepare("NVIDIA H200", tmp_path)
        assert "no tuned configs for NVIDIA H200" in caplog.text and "fla_configs.py tune" in caplog.text
        caplog.clear()
        (tmp_path / gpu_folder("NVIDIA H200")).mkdir()
        assert fla_tuning.prepare("NVIDIA H200", tmp_path)
        assert not fla_tuning.prepare("NVIDIA H100", tmp_path)  # the user's variables are set now (by the last)
    assert caplog.text == ""
