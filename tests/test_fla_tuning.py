"""fla's tuned configs kept per GPU (worker/linear_attention/fla_tuning.py, scripts/fla_configs.py):
what a process's autotuners chose is written in fla's own file format, so that fla itself reads it
back in strict mode; dumps of several workers merge; the kept folder is used only where it exists
for this GPU and the user has not set fla's variables."""
from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

from worker.linear_attention import fla_tuning
from worker.linear_attention.fla_tuning import dump, gpu_folder, key_hash, read, use_kept_configs

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import fla_configs  # noqa: E402

KEY = (16, 32, 128, 128, 64, False, "torch.bfloat16", "torch.float32")


@pytest.fixture
def clean_env(monkeypatch):
    monkeypatch.delenv("FLA_CONFIG_DIR", raising=False)
    monkeypatch.delenv("FLA_CACHE_MODE", raising=False)
    return monkeypatch


def test_gpu_folder_is_flas_name():
    assert gpu_folder("NVIDIA H200") == "NVIDIA_H200" and gpu_folder("NVIDIA H100 80GB HBM3") == "NVIDIA_H100_80GB_HBM3"


def test_kept_configs_are_used_where_they_exist_and_the_user_set_nothing(tmp_path, clean_env):
    (tmp_path / "NVIDIA_H200").mkdir()
    assert not use_kept_configs("NVIDIA H100 80GB HBM3", tmp_path)  # none kept for this GPU
    assert "FLA_CONFIG_DIR" not in fla_tuning.os.environ
    fake = types.SimpleNamespace(FlaCacheMode=lambda mode: f"mode {mode}", FLA_CACHE_MODE="disabled")
    clean_env.setitem(sys.modules, "fla.ops.utils.cache", fake)  # as if transformers had imported fla
    assert use_kept_configs("NVIDIA H200", tmp_path)
    assert fla_tuning.os.environ["FLA_CONFIG_DIR"] == str(tmp_path / "NVIDIA_H200")
    assert fla_tuning.os.environ["FLA_CACHE_MODE"] == "strict" and fake.FLA_CACHE_MODE == "mode strict"


def test_the_users_own_fla_settings_win(tmp_path, clean_env):
    (tmp_path / "NVIDIA_H200").mkdir()
    clean_env.setenv("FLA_CACHE_MODE", "disabled")
    assert not use_kept_configs("NVIDIA H200", tmp_path)
    assert "FLA_CONFIG_DIR" not in fla_tuning.os.environ


def _tuner(name: str, config):
    """An fla autotuner that has tuned KEY to ``config`` (no kernel behind it: only its cache is read)."""
    from fla.ops.utils.cache import CachedAutotuner

    tuner = object.__new__(CachedAutotuner)
    tuner.kernel_name, tuner.cache = name, {KEY: config}
    return tuner


def test_fla_reads_back_what_was_dumped_in_strict_mode(tmp_path, monkeypatch):
    cache = pytest.importorskip("fla.ops.utils.cache")
    triton = pytest.importorskip("triton")
    config = triton.Config({"BV": 32, "BK": 64}, num_warps=4, num_stages=3)
    module = types.ModuleType("fla.ops.fake_kernels")
    module.chunk_fake_kernel = _tuner("chunk_fake_kernel", config)
    monkeypatch.setitem(sys.modules, "fla.ops.fake_kernels", module)
    kernels = fla_tuning.tuned()
    assert key_hash(list(KEY)) == cache.AutotuneKey.key_hash(KEY)
    assert dump(tmp_path, {"chunk_fake_kernel": kernels["chunk_fake_kernel"]}) == 1
    monkeypatch.setenv("FLA_CONFIG_DIR", str(tmp_path))
    monkeypatch.setattr(cache, "FLA_CACHE_MODE", cache.FlaCacheMode.STRICT)
    got = cache.load_cached_config("chunk_fake_kernel", cache.AutotuneKey(KEY))
    assert got["kwargs"] == {"BV": 32, "BK": 64} and (got["num_warps"], got["num_stages"]) == (4, 3)
    other = (*KEY[:2], 64, *KEY[3:])  # another head dim: strict mode autotunes it, never reuses this one
    assert cache.load_cached_config("chunk_fake_kernel", cache.AutotuneKey(other)) is None


def test_workers_dumps_merge_and_the_later_choice_wins(tmp_path):
    pytest.importorskip("triton")
    entry = lambda warps: {"autotune_key": list(KEY), "config": {"kwargs": {}, "num_warps": warps}}  # noqa: E731
    other = (1, *KEY[1:])
    dump(tmp_path / "dumps" / "gw0", {"k1": {key_hash(list(KEY)): entry(4)}, "k2": {key_hash(list(other)): entry(2)}})
    dump(tmp_path / "dumps" / "gw1", {"k1": {key_hash(list(KEY)): entry(8)}})
    count, target = fla_configs.merge([tmp_path / "dumps"], "NVIDIA H200", kept=tmp_path / "kept")
    assert target == tmp_path / "kept" / "NVIDIA_H200" and count == 2
    kept = read(target)
    assert kept["k1"][key_hash(list(KEY))]["config"]["num_warps"] == 8 and len(kept["k2"]) == 1
