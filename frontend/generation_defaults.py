"""Sampling defaults of a model: what applies to a request that leaves temperature, top_p or top_k
unset. They come from the checkpoint's ``generation_config.json`` read as transformers'
``generate()`` reads it: without ``do_sample: true`` decoding is greedy; with it, the file's
temperature, top_p and top_k (transformers' own defaults 1.0, 1.0 and 50 where absent)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple

GREEDY_TEMPERATURE = 0.0


class SamplingDefaults(NamedTuple):
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no cut

    @classmethod
    def from_model_dir(cls, path: str | Path) -> SamplingDefaults:
        file = Path(path) / "generation_config.json"
        try:
            config = json.loads(file.read_text()) if file.is_file() else {}
        except (OSError, ValueError):
            config = {}
        if not isinstance(config, dict) or not config.get("do_sample"):
            return cls(temperature=GREEDY_TEMPERATURE)
        return cls(
            temperature=float(config.get("temperature", 1.0)),
            top_p=float(config.get("top_p", 1.0)),
            top_k=int(config.get("top_k", 50)),
        )

    def describe(self) -> str:
        if self.temperature == GREEDY_TEMPERATURE:
            return "greedy"
        return f"temperature {self.temperature:g}, top_p {self.top_p:g}, top_k {self.top_k}"
