"""The frontend's parts on CPU: incremental detokenizer, stop strings, chat templates, validation
and request state, on tests/fake_scheduler.py's byte-level tokenizer (token id = byte value, EOS
256) and on SmolLM2's real one. The process end to end is in test_frontend.py."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).parent))
from fake_scheduler import EOS_ID, write_byte_tokenizer  # noqa: E402

from frontend.api import replies, requests  # noqa: E402
from frontend.detokenize import IncrementalDetokenizer  # noqa: E402
from frontend.request_state import RequestState  # noqa: E402
from frontend.stops import StopMatcher  # noqa: E402
from frontend.tokenizer import ChatTemplateError, ChatTokenizer  # noqa: E402
from frontend.generation_defaults import SamplingDefaults  # noqa: E402
from frontend.validate import Rejected, check_request, prompt_ids, to_scheduler  # noqa: E402
from scheduler.messages.from_scheduler import ModelInfo, TokenUpdate  # noqa: E402

CONTEXT = 256


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    return write_byte_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def tok(tok_dir) -> ChatTokenizer:
    return ChatTokenizer.from_dir(tok_dir)


# ==== units ====


@settings(max_examples=200, deadline=None)
@given(
    text=st.text(st.characters(codec="utf-8", exclude_characters="\ufffd"), max_size=40),
    cuts=st.lists(st.integers(0, 200), max_size=8),
    data=st.data(),
)
def test_detokenizer_never_emits_broken_utf8(tok, text, cuts, data):
    ids = list(text.encode())  # byte tokenizer: multi-byte characters span several ids
    prompt = data.draw(st.lists(st.integers(0, 255).filter(lambda b: b < 0x80), max_size=6))
    detok = IncrementalDetokenizer(tok.decode, prompt)
    bounds = sorted({0, len(ids), *(c % (len(ids) + 1) for c in cuts)})
    pieces = [detok.step(ids[a:b]) for a, b in zip(bounds, bounds[1:])] + [detok.flush()]
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)


def test_detokenizer_flushes_an_incomplete_character(tok):
    detok = IncrementalDetokenizer(tok.decode, [])
    assert detok.step([ord("a"), 0xE2, 0x82]) == "a"
    assert detok.flush() == "\ufffd"


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="abc", max_size=30),
    stops=st.lists(st.text(alphabet="abc", min_size=1, max_size=4), min_size=1, max_size=3),
    cuts=st.lists(st.integers(0, 30), max_size=6),
)
def test_stop_matcher_matches_one_shot_search(text, stops, cuts):
    # The stop string that is complete first, as the text grows character by character.
    ends = [(i + len(s), i) for s in stops if (i := text.find(s)) >= 0]
    want = (text[: min(ends)[1]], True) if ends else (text, False)
    matcher = StopMatcher(stops)
    bounds = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    out, stopped = "", False
    for a, b in zip(bounds, bounds[1:]):
        piece, stopped = matcher.feed(text[a:b])
        out += piece
        if stopped:
            break
    if not stopped:
        out += matcher.flush()
    assert (out, stopped) == want


def test_stop_matcher_holds_back_a_possible_stop_start():
    matcher = StopMatcher(["</s>", "END"])
    assert matcher.feed("hello </") == ("hello ", False)
    assert matcher.feed("x E") == ("</x ", False)
    assert matcher.feed("NDING") == ("", True)


def test_chat_template_renders_like_transformers(tmp_path, tok):
    ids = tok.encode_chat([{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}])
    assert tok.render_chat([{"role": "user", "content": "hi"}]).endswith("<|im_start|>assistant\n")
    assert ids[0] == 257 and tok.decode(ids) == "system\ns\nuser\nhi\nassistant\n"
    with pytest.raises(ChatTemplateError, match="unknown role robot"):
        tok.encode_chat([{"role": "robot", "content": "x"}])
    bos = ChatTokenizer(
        tok.tokenizer,
        "{{ bos_token }}{% for m in messages %}{{ m.content | tojson }}{% endfor %}",
        "<s>",
    )
    assert bos.render_chat([{"role": "user", "content": "é"}]) == '<s>"é"'
    with pytest.raises(ChatTemplateError, match="no chat template"):
        ChatTokenizer(tok.tokenizer).render_chat([{"role": "user", "content": "x"}])


def test_validation_clamps_max_tokens_and_rejects_long_prompts(tok):
    model = ModelInfo(
        name="m", tokenizer_path="", max_context_tokens=10, vocab_size=259, eos_token_ids=[EOS_ID]
    )
    request = requests.Generate(rid="a", prompt="abcd", max_tokens=100, temperature=0.5, seed=3)
    message = to_scheduler(request, "7", prompt_ids(request, tok), model)
    assert (message.rid, message.input_ids, message.max_tokens) == ("7", [97, 98, 99, 100], 6)
    assert (message.sampling.temperature, message.sampling.seed, message.eos_token_ids) == (
        0.5,
        3,
        [EOS_ID],
    )
    with pytest.raises(Rejected, match="10 tokens") as info:
        to_scheduler(request, "8", list(range(10)), model)
    assert info.value.code == replies.CONTEXT_LENGTH
    with pytest.raises(Rejected, match="outside the vocabulary"):
        check_request(requests.Generate(rid="a", input_ids=[1, 300]), 259)


BIG = 2**63


@pytest.mark.parametrize("field,value", [
    ("top_k", BIG), ("top_k", -1), ("top_k", 1.5), ("max_tokens", BIG), ("max_tokens", 0),
    ("seed", BIG), ("seed", -BIG - 1), ("temperature", float("inf")), ("temperature", float("nan")),
    ("temperature", -0.5), ("temperature", 1e300), ("top_p", 0.0), ("top_p", float("nan")),
    ("top_p", 1.5), ("input_ids", [1, BIG]), ("input_ids", [-1]),
])
def test_check_request_refuses_numbers_the_engine_cannot_hold(field, value):
    fields = {"prompt": "x"} if field != "input_ids" else {}
    request = requests.Generate(rid="a", **fields, **{field: value})  # built in Python: not validated
    with pytest.raises(Rejected, match=field if field != "input_ids" else "vocabulary") as info:
        check_request(request, 259)
    assert info.value.code == replies.BAD_REQUEST


def test_check_request_takes_the_edges_and_caps_prompt_and_stop_sizes():
    edge = requests.Generate(rid="a", prompt="x", top_k=BIG - 1, seed=-BIG, max_tokens=BIG - 1, temperature=0.0,
                             top_p=1.0, input_ids=None)
    check_request(edge, 259)
    with pytest.raises(Rejected, match="10 characters; this server takes at most 9"):
        check_request(requests.Generate(rid="a", prompt="x" * 10), 259, max_prompt_chars=9)
    chat = [requests.ChatMessage(role="user", content="y" * 6)]
    with pytest.raises(Rejected, match="characters"):
        check_request(requests.Generate(rid="a", messages=chat), 259, max_prompt_chars=9)
    with pytest.raises(Rejected, match="stop strings"):
        check_request(requests.Generate(rid="a", prompt="x", stop=["s"] * 17), 259)


def test_check_request_refuses_max_tokens_past_the_whole_context():
    """Clamped to the room the prompt leaves, up to the context; past it no prompt could ever leave
    that room (stress.py's 2**63 - 1 ran a request to the end of the context, unanswered for minutes)."""
    check_request(requests.Generate(rid="a", prompt="x", max_tokens=CONTEXT), 259, context_tokens=CONTEXT)
    for too_many in (CONTEXT + 1, BIG - 1):
        with pytest.raises(Rejected, match=f"max_tokens {too_many} is more than .* context of {CONTEXT}") as info:
            check_request(requests.Generate(rid="a", prompt="x", max_tokens=too_many), 259, context_tokens=CONTEXT)
        assert info.value.code == replies.CONTEXT_LENGTH


def test_top_k_past_the_vocabulary_is_no_cut_and_unset_fields_take_the_defaults(tok):
    model = ModelInfo(name="m", tokenizer_path="", max_context_tokens=10, vocab_size=259, eos_token_ids=[])
    request = requests.Generate(rid="a", prompt="ab", top_k=BIG - 1)
    defaults = SamplingDefaults(temperature=0.6, top_p=0.95, top_k=20)
    sampling = to_scheduler(request, "1", [97, 98], model, defaults).sampling
    assert (sampling.temperature, sampling.top_p, sampling.top_k) == (0.6, 0.95, 259)


def test_sampling_defaults_read_generation_config_as_transformers_does(tmp_path):
    assert SamplingDefaults.from_model_dir(tmp_path).temperature == 0.0  # no file: greedy
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": 2, "temperature": 0.3}')
    assert SamplingDefaults.from_model_dir(tmp_path).temperature == 0.0  # do_sample unset: greedy
    (tmp_path / "generation_config.json").write_text('{"do_sample": true, "temperature": 0.6, "top_p": 0.95}')
    assert SamplingDefaults.from_model_dir(tmp_path) == SamplingDefaults(0.6, 0.95, 50)


def test_request_state_strips_eos_and_reports_usage(tok):
    state = RequestState(
        envelope=[b"id"],
        client_rid="c",
        tokenizer=tok,
        prompt_ids=[1],
        stream=False,
        stop=[],
        eos_token_ids=[EOS_ID],
    )
    assert (
        state.on_update(TokenUpdate(rid="r", token_ids=[104, 0xC3], cached_prompt_tokens=1)) is None
    )
    chunk = state.on_update(
        TokenUpdate(rid="r", token_ids=[0xA9, EOS_ID], finished=True, finish_reason="stop")
    )
    assert (chunk.text, chunk.token_ids, chunk.finish_reason) == (
        "hé",
        [104, 0xC3, 0xA9, EOS_ID],
        "stop",
    )
    assert chunk.usage == replies.Usage(
        prompt_tokens=1, completion_tokens=4, cached_prompt_tokens=0
    )


# ==== the default model's real tokenizer (SmolLM2's byte-level BPE and chat template) ====


@pytest.fixture(scope="module")
def smollm() -> ChatTokenizer:
    default_model = pytest.importorskip("worker.default_model")
    try:
        path = default_model.gguf_path()
    except RuntimeError as exc:
        pytest.skip(str(exc))
    from gguf import GGUFReader

    reader = GGUFReader(path)
    spec = default_model.read_spec(reader)
    tok = default_model.tokenizer_from_gguf(reader)
    return ChatTokenizer(
        tok, spec.chat_template, tok.id_to_token(spec.bos_id), tok.id_to_token(spec.eos_id)
    )


CONVERSATIONS = [
    [{"role": "user", "content": "Hi! What's 12*34?"}],
    [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "Grüße 😀"},
        {"role": "assistant", "content": "Hallo."},
        {"role": "user", "content": "日本語で?"},
    ],
]


@pytest.mark.parametrize("conversation", CONVERSATIONS)
def test_chat_template_matches_transformers(smollm, conversation):
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(
        tokenizer_object=smollm.tokenizer,
        chat_template=smollm.chat_template,
        bos_token=smollm.bos_token,
        eos_token=smollm.eos_token,
    )
    want = hf.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    assert smollm.render_chat(conversation) == want
    assert smollm.encode_chat(conversation) == hf(want, add_special_tokens=False)["input_ids"]


@settings(max_examples=100, deadline=None)
@given(
    text=st.text(st.characters(codec="utf-8", exclude_characters="\ufffd"), max_size=30),
    data=st.data(),
)
def test_detokenizer_on_real_bpe_tokens(smollm, text, data):
    ids = smollm.encode(text)
    assume(smollm.decode(ids) == text)  # the GGUF vocabulary lacks a few byte tokens
    cuts = data.draw(st.lists(st.integers(0, len(ids)), max_size=6))
    detok = IncrementalDetokenizer(smollm.decode, smollm.encode_chat(CONVERSATIONS[0]))
    bounds = sorted({0, len(ids), *cuts})
    pieces = [detok.step(ids[a:b]) for a, b in zip(bounds, bounds[1:])] + [detok.flush()]
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)
