"""frontend/prompt_pieces.py: a rendered chat prompt encoded piece by piece between added tokens,
the long pieces kept, gives exactly the ids of encoding it whole, turn after turn of a session."""
from __future__ import annotations

import random
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers

from frontend import prompt_pieces
from frontend.kept_ids import KeptIds
from frontend.prompt_pieces import PromptPieces, piecewise_reason
from frontend.tokenizer import ChatTokenizer
from worker import default_model as dm

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TEXTS = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "In 2024, 1234567 people paid $3.50 each; pi is 3.14159",
    " Ünïcödé — naïve café, 日本語のテキスト, emoji 😀🚀 and \u200b zero-width.",
    "def f(x):\n    return x ** 2  # square\n\n\tif a != b: print('it\\'s', \"ok\")\r\n",
    "   leading spaces and trailing   I'm sure you've heard   ",
    "<|im_end|><|im_start|><|im_start|>user<|endoftext|>",  # added tokens next to each other
    "<|im_star|> <|im_end|", "\n", "",
]


@pytest.fixture(scope="module")
def smollm2() -> Tokenizer:
    """The default model's tokenizer (byte-level BPE, digits split, ChatML added tokens), as Qwen's."""
    return dm.tokenizer_from_gguf()


def _whole(tok: Tokenizer, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False).ids


def _long(rng: random.Random, n: int, texts: list[str] = TEXTS) -> str:
    return "".join(rng.choice(texts) for _ in range(n))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from(TEXTS + ["<|im_start|>", "<|im_end|>", "x", "  ", "12"]), max_size=30))
def test_pieces_join_to_the_whole_encoding(smollm2, parts):
    pieces = PromptPieces(smollm2)
    assert pieces.reason is None
    text = "".join(parts) * 20  # long pieces get kept
    assert pieces.encode(text) == _whole(smollm2, text)
    assert pieces.encode(text) == _whole(smollm2, text)  # from the kept pieces


@settings(max_examples=100, deadline=None)
@given(st.lists(st.one_of(st.text(min_size=0, max_size=300), st.sampled_from(["<|im_start|>", "<|endoftext|>"])),
                max_size=12))
def test_any_text_between_added_tokens(smollm2, parts):
    text = "".join(parts)
    assert PromptPieces(smollm2).encode(text) == _whole(smollm2, text)


def test_a_growing_session_encodes_only_its_new_messages(smollm2):
    chat = ChatTokenizer(smollm2, CHATML)
    rng = random.Random(0)
    plain = TEXTS[:5]  # no added tokens inside a message: one kept piece each
    messages = [{"role": "system", "content": _long(rng, 30, plain)}]
    for turn in range(12):
        messages.append({"role": "user" if turn % 2 else "assistant", "content": _long(rng, 40, plain)})
        before = chat.pieces.kept.hits
        ids = chat.encode_chat(messages)
        assert ids == _whole(smollm2, chat.render_chat(messages))
        assert chat.pieces.kept.hits - before == (len(messages) - 1 if turn else 0)  # the earlier messages: kept
    assert chat.pieces.kept.misses == len(messages)  # each message encoded once


def test_the_kept_pieces_stay_under_their_bound(smollm2, monkeypatch):
    monkeypatch.setattr(prompt_pieces, "MIN_CACHED_CHARS", 8)
    pieces = PromptPieces(smollm2, KeptIds(max_bytes=3000))
    rng = random.Random(1)
    for _ in range(40):
        text = "<|im_start|>".join(_long(rng, 3) for _ in range(5))
        assert pieces.encode(text) == _whole(smollm2, text)
        assert 0 < pieces.kept.bytes <= 3000
    assert pieces.kept.tokens == sum(len(ids) for ids in pieces.kept._kept.values())
    assert pieces.kept.bytes == sum(len(p) + 4 * len(ids) for p, ids in pieces.kept._kept.items())


def test_a_piece_of_few_tokens_and_many_characters_counts_its_characters(smollm2):
    """Runs of spaces are many characters a token: the bound is memory, not tokens."""
    pieces = PromptPieces(smollm2, KeptIds(max_bytes=100_000))
    for n in range(30):
        text = f"<|im_start|>{n}" + " " * 20_000
        assert pieces.encode(text) == _whole(smollm2, text)
    assert pieces.kept.bytes <= 100_000 and len(pieces.kept._kept) <= 5


def test_threads_encode_at_once(smollm2):
    pieces, rng = PromptPieces(smollm2, KeptIds(max_bytes=100_000)), random.Random(2)
    texts = ["<|im_end|>\n<|im_start|>".join(_long(rng, 12) for _ in range(6)) for _ in range(8)]
    wrong: list[str] = []

    def run(k: int) -> None:
        for i in range(30):
            text = texts[(k + i) % len(texts)]
            if pieces.encode(text) != _whole(smollm2, text):
                wrong.append(text)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(4)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert not wrong and pieces.kept.bytes <= 100_000


def _bpe(normalizer=None, pre_tokenizer=None, added: list[AddedToken] = ()) -> Tokenizer:
    vocab = {c: i for i, c in enumerate("▁abcdefghijklmnopqrstuvwxyz <>|_")}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="_"))
    tok.normalizer, tok.pre_tokenizer = normalizer, pre_tokenizer
    tok.add_special_tokens([AddedToken("<|s|>", special=True, normalized=False)])
    tok.add_tokens(list(added))
    return tok


@pytest.mark.parametrize("tok, reason", [
    (_bpe(pre_tokenizer=pre_tokenizers.Metaspace(prepend_scheme="first")), "prepend_scheme first"),
    (_bpe(pre_tokenizer=pre_tokenizers.Sequence([pre_tokenizers.Digits(),
                                                 pre_tokenizers.Metaspace(prepend_scheme="first")])),
     "prepend_scheme first"),  # found inside a Sequence too
    (_bpe(added=[AddedToken("<x>", lstrip=True)]), "lstrip/rstrip/single_word"),
    (_bpe(added=[AddedToken("<x>", single_word=True)]), "lstrip/rstrip/single_word"),
])
def test_tokenizers_that_are_not_piecewise_encode_whole(tok, reason):
    """Metaspace's "first" treats the first piece alone (Mixtral), an lstrip token eats the space
    before it: such prompts are encoded whole, so the ids are still the whole encoding's."""
    assert reason in piecewise_reason(tok)
    pieces = PromptPieces(tok)
    text = "ab <x> cd<|s|> ef<y>gh<|s|>ij " * 30
    assert pieces.encode(text) == _whole(tok, text) and pieces.kept.hits == pieces.kept.misses == 0


def test_special_tokens_encoded_as_text_are_not_pieces(smollm2):
    """``encode_special_tokens`` makes tokenizers read ``<|im_start|>`` as text: the prompt is encoded whole."""
    tok = Tokenizer.from_str(smollm2.to_str())
    tok.encode_special_tokens = True
    text = ("<|im_start|>user\n" + "x" * 300 + "<|im_end|>") * 2
    pieces = PromptPieces(tok)
    assert pieces.encode(text) == _whole(tok, text) != _whole(smollm2, text)
    assert pieces.kept.hits == pieces.kept.misses == 0


def test_a_tokenizer_json_that_pads_or_truncates_does_neither(smollm2):
    """A tokenizer.json may carry padding and truncation; a prompt is neither cut nor padded (and a
    batch of pieces would be padded to its longest)."""
    tok = Tokenizer.from_str(smollm2.to_str())
    tok.enable_truncation(64)
    tok.enable_padding(length=None)
    chat = ChatTokenizer(tok, CHATML)
    messages = [{"role": "user", "content": "x" * 300}, {"role": "assistant", "content": "short"}]
    assert chat.encode_chat(messages) == _whole(smollm2, chat.render_chat(messages))
    assert len(chat.encode("y " * 100)) > 64


def test_piecewise_would_be_wrong_where_it_is_refused():
    """The refusal is needed: with prepend_scheme first, the pieces encoded alone differ."""
    tok = _bpe(pre_tokenizer=pre_tokenizers.Metaspace(prepend_scheme="first"))
    text = "ab<|s|>cd"
    alone = [*_whole(tok, "ab"), tok.token_to_id("<|s|>"), *_whole(tok, "cd")]
    assert alone != _whole(tok, text)


@pytest.mark.parametrize("pre_tokenizer", [pre_tokenizers.Metaspace(prepend_scheme="always"),
                                           pre_tokenizers.ByteLevel(add_prefix_space=True),
                                           pre_tokenizers.Whitespace()])
def test_other_pipelines_are_piecewise(pre_tokenizer):
    """Normalizers and pre-tokenizers that work on each piece alone; an added token matched after
    normalizing (``<Y>`` lowercased to ``<y>``) is found inside its piece, as in the whole text."""
    tok = _bpe(normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()]), pre_tokenizer,
               added=[AddedToken("<y>", normalized=True), AddedToken("<|s|>x", normalized=True)])
    tok.decoder = decoders.ByteLevel()
    pieces = PromptPieces(tok)
    assert pieces.reason is None
    text = "Ab cd<|s|> ef<Y>  GH<|s|><|s|>ij<|s|>x\n" * 40 + "<|s|>" + "long piece " * 30
    assert pieces.encode(text) == _whole(tok, text) == pieces.encode(text)
    assert tok.token_to_id("<y>") in _whole(tok, text) and pieces.kept.hits == 1  # the long piece, kept


def test_the_benchmark_runs_a_short_session(monkeypatch, capsys):
    """scripts/bench_prompt_tokenize.py, 4 turns: the default model's tokenizer is piecewise and each
    quarter's row is printed beside its bound."""
    from scripts import bench_prompt_tokenize

    monkeypatch.setattr("sys.argv", ["bench_prompt_tokenize.py", "--turns", "4", "--turn-tokens", "300"])
    bench_prompt_tokenize.main()
    out = capsys.readouterr().out
    assert "piecewise: yes" in out and out.count("\n") == 8 and "last turn" in out  # 4 rows, a turn each
