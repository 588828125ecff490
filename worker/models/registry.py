"""The families Sluice runs, keyed by the checkpoint's ``architectures``.

A family is one module under ``worker/models/`` that declares a ``Family``: how its ``config.json``
reads into ``ModelConfig``'s fields, where its dense weights live in the checkpoint, and which
decoder runs it. The engine, the scheduler and ``moe_offload`` never see a family's name.
"""
from __future__ import annotations

from typing import Callable, NamedTuple


class Family(NamedTuple):
    name: str
    architectures: tuple[str, ...]
    # (the text part of config.json, the whole of it, source) -> ModelConfig's fields; raises CheckpointError
    config_fields: Callable[[dict, dict, str], dict]
    # the part of config.json that describes the text model (a multimodal checkpoint nests it)
    text_config: Callable[[dict], dict] = lambda raw: raw
    # (ModelConfig, ModelWeights) -> Targets, for a family whose dense weights are not the classic
    # or hybrid layouts of ``worker.models.weights`` (None: those)
    targets: Callable | None = None


FAMILIES: dict[str, Family] = {}


def register(family: Family) -> Family:
    for arch in family.architectures:
        FAMILIES[arch] = family
    return family


def family_for(architectures: list[str]) -> Family | None:
    _load()
    return next((FAMILIES[a] for a in architectures if a in FAMILIES), None)


def family_named(name: str) -> Family:
    _load()
    return next(f for f in FAMILIES.values() if f.name == name)


def supported_architectures() -> list[str]:
    _load()
    return list(FAMILIES)


def _load() -> None:
    """Import the family modules (each registers itself); late, so that config stays import-light."""
    from worker.models import classic, gpt_oss, qwen3_hybrid  # noqa: F401
