"""The model's tokenizer and chat template, for the offline entry point (the frontend has its own)."""
from __future__ import annotations

import json
from pathlib import Path

from worker.errors import CheckpointError


class ChatTokenizer:
    def __init__(self, model_dir: str | Path):
        from tokenizers import Tokenizer

        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise CheckpointError(f"{model_dir}: no tokenizer.json")
        self.tokenizer = Tokenizer.from_file(str(path))
        cfg_path = model_dir / "tokenizer_config.json"
        self.config = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def apply_chat_template(self, messages: list[dict]) -> str:
        import jinja2

        template = self.config.get("chat_template")
        if not template:
            raise CheckpointError("tokenizer_config.json has no chat_template")
        env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
        return env.from_string(template).render(messages=messages, add_generation_prompt=True,
                                                bos_token=_token_text(self.config.get("bos_token")),
                                                eos_token=_token_text(self.config.get("eos_token")))


def _token_text(token) -> str:
    return token.get("content", "") if isinstance(token, dict) else (token or "")
