"""What the harmony tests serve: o200k_harmony as a ``tokenizer.json`` (from the
``o200k_base.tiktoken`` that scripts/fetch_o200k.py puts in place; its ids decode exactly, but
without merges a word that is not one token encodes as bytes: the served path only decodes), and
a tiny gpt-oss of that vocabulary whose greedy reply is a chain of tokens fixed in its weights.

The chained model: attention and experts write nothing (their output projections are zero), so
the last layer sees only the current token's embedding; chain token i embeds as the unit vector
i, and the unembedding row of token i+1 reads it. Greedy decoding then walks the chain from any
prompt that ends in its first token, through the whole serving path."""
from __future__ import annotations

import base64
import json
from functools import lru_cache
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tests.fake_scheduler import _bytes_to_unicode
from tests.tiny_gpt_oss import FULL, SLIDING, write_tiny_gpt_oss

VOCAB = 201088  # o200k_harmony's size, its reserved ids included
FIRST_SPECIAL = 199998
NAMED = {199998: "<|startoftext|>", 199999: "<|endoftext|>", 200002: "<|return|>", 200003: "<|constrain|>",
         200005: "<|channel|>", 200006: "<|start|>", 200007: "<|end|>", 200008: "<|message|>", 200012: "<|call|>"}
O200K_PATTERN = "|".join([
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}", r" ?[^\s\p{L}\p{N}]+[\r\n/]*", r"\s*[\r\n]+", r"\s+(?!\S)", r"\s+"])


@lru_cache(maxsize=1)
def harmony_tokenizer_json() -> str:
    """o200k_harmony for ``tokenizers`` (once per test session)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    from frontend.http.harmony.encoding import VOCAB_FILE, encodings_dir

    ranks = {base64.b64decode(token): int(rank) for token, rank in
             (line.split(b" ") for line in (encodings_dir() / VOCAB_FILE).read_bytes().splitlines())}
    chars = _bytes_to_unicode()
    text = lambda b: "".join(chars[x] for x in b)  # noqa: E731
    tokenizer = Tokenizer(models.BPE(vocab={text(t): r for t, r in ranks.items()}, merges=[], ignore_merges=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(O200K_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(NAMED.get(i, f"<|reserved_{i}|>"), special=True)
                                  for i in range(FIRST_SPECIAL, VOCAB)])  # in id order: they get these ids
    return tokenizer.to_str()


def write_chained_gpt_oss(path: Path, chain: list[int], hidden: int = 32) -> None:
    """A tiny gpt-oss of o200k_harmony's vocabulary, with its tokenizer, whose greedy successor of
    ``chain[i]`` is ``chain[i + 1]`` (written with a small vocabulary, then widened: transformers
    takes long to build a 201k-row model)."""
    assert len(chain) <= hidden and len(set(chain)) == len(chain), "chain tokens are distinct, at most hidden"
    write_tiny_gpt_oss(path, layer_types=(SLIDING, FULL), hidden=hidden, vocab=128, experts=4, top_k=2, yarn=False)
    state = load_file(path / "model.safetensors")
    for name in state:
        if name.endswith(("o_proj.weight", "o_proj.bias", "down_proj", "down_proj_bias")):
            state[name].zero_()
    state["model.norm.weight"].fill_(1.0)
    embed = torch.randn(VOCAB, hidden, generator=torch.Generator().manual_seed(0)) * 0.02
    unembed = torch.zeros(VOCAB, hidden)
    for i, token in enumerate(chain):
        embed[token] = torch.nn.functional.one_hot(torch.tensor(i), hidden)
        if i + 1 < len(chain):
            unembed[chain[i + 1], i] = 1.0
    state["model.embed_tokens.weight"], state["lm_head.weight"] = embed, unembed
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "vocab_size": VOCAB, "eos_token_id": 199999}))
    (path / "tokenizer.json").write_text(harmony_tokenizer_json())
