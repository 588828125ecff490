"""A bad checkpoint directory gives one clear error line, not a traceback from inside torch."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from tests.tiny_models import write_tiny
from worker.errors import CheckpointError
from worker.runner import ModelRunner, RunnerConfig

GENERATE = str(Path(__file__).resolve().parents[1] / "scripts" / "generate.py")


@pytest.fixture
def tiny_dir(tmp_path):
    write_tiny(tmp_path, "qwen3_moe", layers=1, experts=4)
    return tmp_path


def rewrite_tensors(path, edit):
    file = path / "model.safetensors"
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def load(path):
    return ModelRunner(RunnerConfig(str(path), device="cpu", dtype="float32", kv_tokens=64))


def test_missing_tensor_is_named(tiny_dir):
    rewrite_tensors(tiny_dir, lambda t: t.pop("model.layers.0.mlp.experts.2.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensor model\.layers\.0\.mlp\.experts\.2\.up_proj\.weight"):
        load(tiny_dir)


def test_wrong_shape_is_named(tiny_dir):
    def edit(t):
        t["model.layers.0.self_attn.k_proj.weight"] = t["model.layers.0.self_attn.k_proj.weight"][:-1]
    rewrite_tensors(tiny_dir, edit)
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.self_attn\.k_proj\.weight has shape \(31, 64\), expected \(32, 64\)"):
        load(tiny_dir)


def test_unsupported_architecture_names_supported_ones(tiny_dir):
    cfg = json.loads((tiny_dir / "config.json").read_text())
    cfg["architectures"] = ["LlamaForCausalLM"]
    (tiny_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="unsupported architecture.*MixtralForCausalLM, Qwen3MoeForCausalLM"):
        load(tiny_dir)


def test_cli_prints_one_line(tiny_dir):
    """No tokenizer.json: the CLI exits 2 with a single 'error:' line."""
    proc = subprocess.run([sys.executable, GENERATE, "--model", str(tiny_dir), "--prompt", "hi",
                           "--device", "cpu"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [f"error: {tiny_dir}: no tokenizer.json"]


def test_cli_missing_tensor_one_line(tiny_dir, tmp_path_factory):
    from tokenizers import Tokenizer, models
    Tokenizer(models.WordLevel({"hi": 0, "[UNK]": 1}, unk_token="[UNK]")).save(str(tiny_dir / "tokenizer.json"))
    rewrite_tensors(tiny_dir, lambda t: t.pop("model.norm.weight"))
    proc = subprocess.run([sys.executable, GENERATE, "--model", str(tiny_dir), "--prompt", "hi",
                           "--device", "cpu"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == ["error: checkpoint is missing tensor model.norm.weight"]
