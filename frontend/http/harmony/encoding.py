"""The harmony encoding, loaded once, offline: openai-harmony reads ``o200k_base.tiktoken`` from
``$TIKTOKEN_ENCODINGS_BASE`` (checking its sha256) and would otherwise download it from
openaipublic.blob.core.windows.net. ``scripts/fetch_o200k.py`` rebuilds the file byte for byte
from the npm registry's ``tiktoken`` package into ``encodings_dir()``, which is used when the
variable is not set."""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

from frontend.http.errors import ApiError
from frontend.tokenizer import ChatTokenizer

if TYPE_CHECKING:
    from openai_harmony import HarmonyEncoding

VARIABLE, VOCAB_FILE = "TIKTOKEN_ENCODINGS_BASE", "o200k_base.tiktoken"
# the sha256 that openai-harmony checks (src/tiktoken_ext/public_encodings.rs)
VOCAB_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
# harmony's formatting tokens and their ids in o200k_harmony
FORMATTING_IDS = {"<|start|>": 200006, "<|channel|>": 200005, "<|message|>": 200008, "<|end|>": 200007}


def encodings_dir() -> Path:
    """Where the vocabulary file is looked for: ``$TIKTOKEN_ENCODINGS_BASE``, else Sluice's cache."""
    given = os.environ.get(VARIABLE)
    return Path(given) if given else Path.home() / ".cache" / "sluice" / "tiktoken"


def available() -> bool:
    return (encodings_dir() / VOCAB_FILE).is_file()


@lru_cache(maxsize=1)
def encoding() -> HarmonyEncoding:
    """The gpt-oss encoding; a 503 naming the fix when the vocabulary file is absent."""
    if not available():
        raise ApiError(503, f"gpt-oss's harmony format needs {encodings_dir() / VOCAB_FILE}: run "
                       "python scripts/fetch_o200k.py (or set TIKTOKEN_ENCODINGS_BASE to its folder)")
    os.environ.setdefault(VARIABLE, str(encodings_dir()))  # the library reads the variable only
    from openai_harmony import HarmonyEncodingName, load_harmony_encoding

    return load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)


@lru_cache(maxsize=4)
def speaks_harmony(tokenizer: ChatTokenizer | None) -> bool:
    """Whether the model's vocabulary is o200k_harmony: its formatting tokens at harmony's ids."""
    return tokenizer is not None and all(tokenizer.tokenizer.token_to_id(t) == i for t, i in FORMATTING_IDS.items())


def preload(tokenizer: ChatTokenizer) -> None:
    """Load the encoding now if the model speaks harmony and the vocabulary is there."""
    if speaks_harmony(tokenizer) and available():
        encoding()
