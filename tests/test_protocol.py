"""Both wire protocols: round trips of every message, and every kind of bad frame becoming one
``ProtocolError`` (with the request id when it can still be read)."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from frontend.api import replies, requests
from scheduler.messages import ProtocolError, from_scheduler, to_scheduler

MODEL = from_scheduler.ModelInfo(
    name="m", tokenizer_path="/tok", max_context_tokens=4096, vocab_size=32000, eos_token_ids=[2, 7]
)
MESSAGES = [
    (
        to_scheduler,
        to_scheduler.TokenizedRequest(
            rid="r1",
            input_ids=[1, 2, 3],
            max_tokens=5,
            eos_token_ids=[2],
            ignore_eos=True,
            sampling=to_scheduler.SamplingParams(temperature=0.0, top_k=40, top_p=0.9, seed=123),
            grammar=to_scheduler.Grammar(lark='start: %json {"type": "object"}', what="response_format json_object"),
        ),
    ),
    (to_scheduler, to_scheduler.AbortRequest(rid="r1")),
    (to_scheduler, to_scheduler.StatsRequest(nonce=9)),
    (to_scheduler, to_scheduler.Shutdown()),
    (from_scheduler, from_scheduler.Ready(pid=42, model=MODEL)),
    (
        from_scheduler,
        from_scheduler.TokenBatch(
            updates=[
                from_scheduler.TokenUpdate(rid="a", token_ids=[5]),
                from_scheduler.TokenUpdate(
                    rid="b",
                    token_ids=[6, 2],
                    finished=True,
                    finish_reason="stop",
                    prompt_tokens=10,
                    cached_prompt_tokens=8,
                ),
            ]
        ),
    ),
    (from_scheduler, from_scheduler.RequestError(rid="a", message="out of pages")),
    (
        from_scheduler,
        from_scheduler.StatsReply(
            nonce=9, stats={"running": 3, "hit_rate": 0.5, "name": "x", "n": None}
        ),
    ),
    (from_scheduler, from_scheduler.Heartbeat(pid=42, time=1.5)),
    (requests, requests.Generate(rid="c", prompt="hi", stop=["\n"], stream=True, seed=1)),
    (
        requests,
        requests.Generate(rid="c", messages=[requests.ChatMessage(role="user", content="hi")]),
    ),
    (requests, requests.Generate(rid="c", input_ids=[1, 2], temperature=0.0, top_k=5, top_p=0.5)),
    (requests, requests.Abort(rid="c")),
    (requests, requests.GetStats(rid="s")),
    (replies, replies.Chunk(rid="c", text="é", token_ids=[195, 169])),
    (
        replies,
        replies.Chunk(
            rid="c",
            finish_reason="length",
            usage=replies.Usage(prompt_tokens=3, completion_tokens=4, cached_prompt_tokens=1),
        ),
    ),
    (replies, replies.Error(rid=None, code=replies.BAD_REQUEST, message="no")),
    (replies, replies.Stats(rid="s", stats={"a": 1, "b": 2.5, "c": True})),
]
CODECS = [to_scheduler, from_scheduler, requests, replies]


@pytest.mark.parametrize("module,message", MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip(module, message):
    frame = module.encode(message)
    assert module.decode(frame) == message
    raw = msgspec.msgpack.decode(frame)
    version = getattr(module, "PROTOCOL_VERSION", getattr(module, "API_VERSION", None))
    assert raw["type"] == type(message).__struct_config__.tag and raw["v"] == version


@pytest.mark.parametrize("module", CODECS, ids=lambda m: m.__name__)
@settings(max_examples=300, deadline=None)
@given(frame=st.binary(max_size=64))
def test_random_bytes_raise_protocol_error_only(module, frame):
    try:
        module.decode(frame)
    except ProtocolError:
        pass


def test_messages_of_one_direction_do_not_decode_as_the_other():
    with pytest.raises(ProtocolError, match="unknown|version 1 is not supported"):
        to_scheduler.decode(from_scheduler.encode(from_scheduler.Heartbeat(pid=1, time=0.0)))
    with pytest.raises(ProtocolError, match="unknown"):
        requests.decode(replies.encode(replies.Chunk(rid="x")))


def _raw(**fields) -> bytes:
    return msgspec.msgpack.encode(fields)


@pytest.mark.parametrize(
    "frame,match,rid",
    [
        (b"\xc1", "malformed", None),  # 0xc1 is never valid msgpack
        (b"", "malformed", None),
        (
            _raw(type="generate", v=1, rid="a", prompt=5),
            r"Expected `str \| null`, got `int` - at `\$\.prompt`",
            "a",
        ),
        (
            _raw(type="generate", v=1, rid="a", prompt="x", temperature="hot"),
            r"\$\.temperature",
            "a",
        ),
        (_raw(type="generate", v=1, rid=7, prompt="x"), r"\$\.rid", None),
        (
            _raw(type="launch_missiles", v=1, rid="a"),
            "unknown client->frontend message type 'launch_missiles'",
            "a",
        ),
        (_raw(v=1, rid="a", prompt="x"), "missing required field `type`", "a"),
        (_raw(type="generate", v=2, rid="a", prompt="x"), "version 2 is not supported", "a"),
        (_raw(type="generate", v=1, rid="a", prompt=""), "prompt is empty", "a"),
        (_raw(type="generate", v=1, rid="a", messages=[]), "messages is empty", "a"),
        (_raw(type="generate", v=1, rid="a"), "exactly one of", "a"),
        (_raw(type="generate", v=1, rid="a", prompt="x", input_ids=[1]), "exactly one of", "a"),
        (
            _raw(type="generate", v=1, rid="a", prompt="x", temperature=-0.1),
            r">= 0.0 - at `\$\.temperature`",
            "a",
        ),
        (
            _raw(type="generate", v=1, rid="a", prompt="x", top_p=0.0),
            r"> 0.0 - at `\$\.top_p`",
            "a",
        ),
        (
            _raw(type="generate", v=1, rid="a", prompt="x", top_p=1.5),
            r"<= 1.0 - at `\$\.top_p`",
            "a",
        ),
        (_raw(type="generate", v=1, rid="a", prompt="x", top_k=-1), r"\$\.top_k", "a"),
        (
            _raw(type="generate", v=1, rid="a", prompt="x", max_tokens=0),
            r">= 1 - at `\$\.max_tokens`",
            "a",
        ),
        (_raw(type="generate", v=1, rid="a", input_ids=[-1]), r"\$\.input_ids\[0\]", "a"),
        (_raw(type="generate", v=1, rid="a", prompt="x", stop=[""]), r"\$\.stop\[0\]", "a"),
        (_raw(type="generate", v=1, rid="", prompt="x"), r"\$\.rid", ""),
        (msgspec.msgpack.encode([1, 2]), "Expected `object`", None),
    ],
)
def test_bad_client_frames(frame, match, rid):
    with pytest.raises(ProtocolError, match=match) as info:
        requests.decode(frame)
    assert info.value.rid == rid


def test_bad_scheduler_frames():
    with pytest.raises(ProtocolError, match=r"\$\.updates\[0\]\.finish_reason"):
        from_scheduler.decode(
            _raw(
                type="token_batch",
                v=1,
                updates=[{"rid": "a", "token_ids": [], "finish_reason": "eos"}],
            )
        )
    with pytest.raises(ProtocolError, match=r"\$\.sampling\.top_p"):
        to_scheduler.decode(
            _raw(
                type="tokenized_request",
                v=to_scheduler.PROTOCOL_VERSION,
                rid="a",
                input_ids=[1],
                max_tokens=1,
                sampling={"top_p": 0},
            )
        )
    with pytest.raises(ProtocolError, match="version 0"):
        to_scheduler.decode(_raw(type="shutdown", v=0))


def test_generate_checks_its_shape_when_built_too():
    with pytest.raises(ValueError, match="exactly one of"):
        requests.Generate(rid="a", prompt="x", messages=[])
    with pytest.raises(ValueError, match="input_ids is empty"):
        requests.Generate(rid="a", input_ids=[])


def test_defaults_are_documented_values():
    g = requests.decode(_raw(type="generate", v=1, rid="a", prompt="x"))
    assert (
        g.temperature,
        g.top_k,
        g.top_p,
        g.seed,
        g.max_tokens,
        g.stop,
        g.stream,
        g.ignore_eos,
    ) == (
        None,  # temperature, top_k, top_p: the model's defaults, resolved by the frontend
        None,
        None,
        None,
        256,
        [],
        False,
        False,
    )
    t = to_scheduler.decode(
        _raw(type="tokenized_request", v=to_scheduler.PROTOCOL_VERSION, rid="a", input_ids=[1], max_tokens=2)
    )
    assert (
        t.sampling == to_scheduler.SamplingParams() and t.eos_token_ids == [] and not t.ignore_eos
    )


@pytest.mark.parametrize("codec", [requests.codec, to_scheduler.codec])
def test_deeply_nested_frames_and_non_integer_versions_are_protocol_errors(codec):
    with pytest.raises(ProtocolError):  # not a RecursionError
        codec.decode(b"\x91" * 200_000 + b"\x00")
    with pytest.raises(ProtocolError):  # not a RecursionError
        codec.decode(b"\x81\xa1k" * 100_000 + b"\x00")
    for v in ("1", 1.0, None, [1]):
        with pytest.raises(ProtocolError, match="must be an integer") as info:
            codec.decode(_raw(type=codec.tags[0], v=v, rid="r7"))
        assert info.value.rid == "r7"


def test_a_version_1_scheduler_frame_is_refused():
    """Version 2 added TokenizedRequest.grammar: a version-1 peer would drop the constraint."""
    with pytest.raises(ProtocolError, match="version 1 is not supported"):
        to_scheduler.decode(_raw(type="shutdown", v=1))
