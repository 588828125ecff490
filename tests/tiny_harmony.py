"""What the harmony tests serve: o200k_harmony as a ``tokenizer.json`` (the gpt-oss geometries'
tokenizer, from the ``o200k_base.tiktoken`` that scripts/fetch_o200k.py puts in place), and a
tiny gpt-oss of that vocabulary whose greedy reply is a chain of tokens fixed in its weights.

The chained model: attention and experts write nothing (their output projections are zero), so
the last layer sees only the current token's embedding; chain token i embeds as the unit vector
i, and the unembedding row of token i+1 reads it. Greedy decoding then walks the chain from any
prompt that ends in its first token, through the whole serving path."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tests.tiny_gpt_oss import FULL, SLIDING, write_tiny_gpt_oss

VOCAB = 201088  # o200k_harmony's size, its reserved ids included


def harmony_tokenizer_json() -> str:
    """o200k_harmony for ``tokenizers``: the gpt-oss geometries' tokenizer (written once)."""
    from worker.geometry_tokenizer import o200k_harmony_dir

    return (o200k_harmony_dir() / "tokenizer.json").read_text()


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
