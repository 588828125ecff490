"""The families Sluice runs, keyed by the checkpoint's ``architectures``.

A family is one module under ``worker/models/`` that declares its ``Family`` entries in
``FAMILIES``: how its ``config.json`` reads into ``ModelConfig``'s fields, where its dense weights
live in the checkpoint, and which decoder runs it. The engine, the scheduler and ``moe_offload``
never see a family's name. The family modules are imported on first use, so that ``worker.config``
stays import-light; they import only ``worker.models.family_config`` below it, never this module.
"""
from __future__ import annotations

import functools

from worker.models.family_config import Family

__all__ = ["Family", "family_for", "family_named", "supported_architectures"]


@functools.cache
def _families() -> dict[str, Family]:
    from worker.models import classic, gpt_oss, qwen3_hybrid

    return {arch: family for module in (classic, qwen3_hybrid, gpt_oss) for family in module.FAMILIES
            for arch in family.architectures}


def family_for(architectures: list[str]) -> Family | None:
    return next((_families()[a] for a in architectures if a in _families()), None)


def family_named(name: str) -> Family:
    return next(f for f in _families().values() if f.name == name)


def supported_architectures() -> list[str]:
    return list(_families())
