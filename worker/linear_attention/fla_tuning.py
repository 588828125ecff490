"""fla's autotuned kernels, tuned once per GPU model and kept in the repository.

fla's chunked gated-delta-rule kernels autotune on their first call for each head shape and
dtype: on a freshly started machine that compiles and times every config of about seven kernels
(H100, cold Triton cache: 65 s for Qwen3.5-35B-A3B's shape, by ``scripts/fla_configs.py tune``), in
the GPU suite and in a hybrid model's warm-up alike. fla can instead read each kernel's chosen
config from files (``FLA_CONFIG_DIR``, ``FLA_CACHE_MODE``; fla's ``ops/utils/cache.py``). So:

- ``use_kept_configs`` (before fla's first use) points fla at ``fla_configs/<GPU>/`` where that
  folder exists and the user set neither variable, in fla's ``strict`` mode: a key tuned before
  is read, any other is autotuned as before (never a config tuned for another shape); where no
  folder is kept for the card it logs one line naming ``scripts/fla_configs.py tune``;
- ``cache_every_tuner``: fla reads kept configs only through its ``CachedAutotuner``, which few of
  its kernels ask for by name (fla 0.6: the l2norm and the conv); the chunked gated-delta kernels
  use ``triton.autotune``, and fla's way to swap that globally (``configure_fla_cache_autotune``)
  must run before its kernels are defined, while importing it imports them all. So once fla is
  imported its plain Triton autotuners are made ``CachedAutotuner``s (the class fla's swap would
  have built, with the kernel name it takes): the same tuners that first look for a kept config;
  ``prepare`` does both, before fla's first use;
- ``tuned`` reads the configs this process's autotuners chose and ``dump`` writes them in fla's
  file format (a GPU suite's workers each their own: ``SLUICE_FLA_DUMP``, see ``tests/conftest.py``);
  ``scripts/fla_configs.py merge`` joins such dumps into ``fla_configs/<GPU>/``.

May import: the standard library (fla and triton inside the functions that read or write their tuners).
"""
from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

log = logging.getLogger("sluice.worker")
KEPT = Path(__file__).with_name("fla_configs")
MODE = "strict"


def gpu_folder(device_name: str) -> str:
    """The folder fla reads a GPU's configs from (its ``sanitize_gpu_name``)."""
    from fla.ops.utils.cache import sanitize_gpu_name

    return sanitize_gpu_name(device_name)


def use_kept_configs(device_name: str, kept: Path = KEPT) -> bool:
    """Point fla at the kept configs of ``device_name`` (see the module docstring); whether it did."""
    if "FLA_CONFIG_DIR" in os.environ or "FLA_CACHE_MODE" in os.environ:
        return False  # the user's own settings
    folder = kept / gpu_folder(device_name)
    if not folder.is_dir():
        log.info("fla keeps no tuned configs for %s here: its kernels autotune on first use (about a minute a "
                 "head shape); `python scripts/fla_configs.py tune MODEL` keeps them", device_name)
        return False
    from fla.ops.utils import cache  # fla reads its mode once, at import: set it there too

    os.environ["FLA_CONFIG_DIR"], os.environ["FLA_CACHE_MODE"] = str(folder), MODE
    cache.FLA_CACHE_MODE = cache.FlaCacheMode(MODE)
    return True


def cache_every_tuner() -> int:
    """fla's plain Triton autotuners made fla's ``CachedAutotuner`` (module docstring); how many."""
    from triton.runtime.autotuner import Autotuner

    import fla.ops  # noqa: F401  every kernel module of fla's ops
    from fla.ops.utils.cache import CachedAutotuner

    changed = 0
    for tuner in _autotuners():
        if type(tuner) is Autotuner:
            fn = tuner.fn  # the name CachedAutotuner.__init__ gives it
            tuner.kernel_name = fn.fn.__name__ if hasattr(fn, "fn") else fn.__name__
            tuner.__class__ = CachedAutotuner
            changed += 1
    return changed


def _autotuners() -> list:
    """Every Triton autotuner that fla's imported modules hold, under any ``triton.heuristics``."""
    from triton.runtime.autotuner import Autotuner, Heuristics

    found: dict[int, Autotuner] = {}
    for name, module in list(sys.modules.items()):
        if not name.startswith("fla."):
            continue
        for value in vars(module).values():
            while isinstance(value, Heuristics):
                value = value.fn
            if isinstance(value, Autotuner):
                found[id(value)] = value
    return list(found.values())


def prepare(device_name: str, kept: Path = KEPT) -> bool:
    """Before fla's first use on a GPU: its kept configs, read by every tuner; whether any are kept."""
    used = use_kept_configs(device_name, kept)
    cache_every_tuner()
    return used


def config_entry(key: tuple, config) -> dict:
    """One tuned key and its ``triton.Config`` as fla's files hold them."""
    return {"autotune_key": list(key),
            "config": {"kwargs": dict(config.kwargs), "num_warps": config.num_warps, "num_stages": config.num_stages,
                       "num_ctas": getattr(config, "num_ctas", 1), "maxnreg": getattr(config, "maxnreg", None)}}


def tuned() -> dict[str, dict[str, dict]]:
    """Kernel name -> {key hash: entry} of every fla autotuner in this process that has tuned."""
    from fla.ops.utils.cache import AutotuneKey, CachedAutotuner

    out: dict[str, dict[str, dict]] = {}
    for tuner in _autotuners():
        if isinstance(tuner, CachedAutotuner) and tuner.cache:
            entries = out.setdefault(tuner.kernel_name, {})
            for key, config in tuner.cache.items():
                entries[AutotuneKey.key_hash(key)] = config_entry(key, config)
    return out


def dump(folder: Path, kernels: dict[str, dict[str, dict]]) -> int:
    """``kernels`` (as ``tuned`` gives them) merged into ``folder``'s files; the entries written."""
    import triton

    folder.mkdir(parents=True, exist_ok=True)
    for name, entries in kernels.items():
        path = folder / f"{name}.json"
        old = json.loads(path.read_text())["autotune_entries"] if path.exists() else {}
        doc = {"kernel_name": name, "triton_version": triton.__version__, "autotune_entries": {**old, **entries}}
        path.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    return sum(len(entries) for entries in kernels.values())


def read(folder: Path) -> dict[str, dict[str, dict]]:
    """A dump folder's entries, as ``tuned`` gives them."""
    return {path.stem: json.loads(path.read_text())["autotune_entries"] for path in sorted(folder.glob("*.json"))}
