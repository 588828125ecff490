"""Client ``Generate`` -> scheduler ``TokenizedRequest``: check every field against what the engine
can hold, tokenize (or render the chat template), and check the prompt against the model that the
scheduler announced in ``Ready``.

``check_request`` is the one place where a request's numbers and sizes are checked; every front
door (the ZMQ socket, the HTTP server) calls it on the ``Generate`` it built, before any work. The
typed decoder already enforces some ranges, but a struct built in Python is not validated, and
the decoder accepts integers up to 2**64 - 1, more than the engine's int64 tensors hold.

``max_tokens`` is clamped to the room the prompt leaves rather than refused, so a client need not
count its prompt's tokens; a prompt that leaves no room for one generated token is refused, and so
is a ``max_tokens`` past the model's whole context (no prompt leaves that much room: 2**63 - 1
would otherwise run a request to the end of the context and answer only then)."""

from __future__ import annotations

import math

from frontend.api.replies import BAD_REQUEST, CONTEXT_LENGTH
from frontend.api.requests import Generate
from frontend.generation_defaults import SamplingDefaults
from frontend.tokenizer import ChatTemplateError, ChatTokenizer
from scheduler.messages.from_scheduler import ModelInfo
from scheduler.messages.to_scheduler import SamplingParams, TokenizedRequest

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_PROMPT_CHARS = 1_000_000  # default of --max-prompt-chars: a 128k-token prompt is ~500k chars
MAX_STOP_STRINGS, MAX_STOP_CHARS = 16, 1000
MAX_GRAMMAR_CHARS = 256 << 10  # a grammar compiles on the scheduler's thread: its size is bounded first
MAX_TEMPERATURE = 1e6  # logits / 1e6 is already uniform; larger is the same draw


class Rejected(ValueError):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def _refuse(message: str) -> Rejected:
    return Rejected(BAD_REQUEST, message)


def check_int(name: str, value: int | None, low: int, high: int = INT64_MAX) -> None:
    if value is not None and not (type(value) is int and low <= value <= high):
        raise _refuse(f"{name} must be an integer in [{low}, {high}], got {value!r}")


def check_float(name: str, value: float | None, low: float, high: float, low_open: bool = False) -> None:
    if value is None:
        return
    ok = isinstance(value, (int, float)) and math.isfinite(value) and value <= high
    ok = ok and (value > low if low_open else value >= low)
    if not ok:
        bracket = "(" if low_open else "["
        raise _refuse(f"{name} must be a finite number in {bracket}{low}, {high}], got {value!r}")


def check_sampling(temperature: float | None, top_p: float | None, top_k: int | None,
                   seed: int | None) -> None:
    """Sampling parameters; None means the model's default (always valid)."""
    check_float("temperature", temperature, 0.0, MAX_TEMPERATURE)
    check_float("top_p", top_p, 0.0, 1.0, low_open=True)
    check_int("top_k", top_k, 0)
    check_int("seed", seed, INT64_MIN)


def check_request(request: Generate, vocab_size: int, max_prompt_chars: int = MAX_PROMPT_CHARS,
                  context_tokens: int = INT64_MAX) -> None:
    """Numbers and sizes of ``request``, before it is tokenized; raises ``Rejected``.
    ``context_tokens``: the model's context, the most ``max_tokens`` that can ever be honoured."""
    check_sampling(request.temperature, request.top_p, request.top_k, request.seed)
    check_int("max_tokens", request.max_tokens, 1)
    if request.max_tokens > context_tokens:
        raise Rejected(CONTEXT_LENGTH, f"max_tokens {request.max_tokens} is more than the model's whole "
                       f"context of {context_tokens} tokens")
    if len(request.stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in request.stop):
        raise _refuse(f"at most {MAX_STOP_STRINGS} stop strings of at most {MAX_STOP_CHARS} characters")
    bad_stops = [i for i in request.stop_token_ids if not (type(i) is int and 0 <= i < vocab_size)]
    if len(request.stop_token_ids) > MAX_STOP_STRINGS or bad_stops:
        raise _refuse(f"at most {MAX_STOP_STRINGS} stop_token_ids, each inside the vocabulary (size {vocab_size})")
    if request.grammar is not None and len(request.grammar.lark) > MAX_GRAMMAR_CHARS:
        raise _refuse(f"{request.grammar.what}: the grammar has {len(request.grammar.lark)} characters; at most "
                      f"{MAX_GRAMMAR_CHARS}")
    if request.input_ids is not None:
        if len(request.input_ids) > max_prompt_chars:  # before looking at each id
            raise _refuse(f"input_ids has {len(request.input_ids)} ids; this server takes at most "
                          f"{max_prompt_chars} (--max-prompt-chars)")
        bad = [i for i in request.input_ids if not (type(i) is int and 0 <= i < vocab_size)]
        if bad:
            raise _refuse(f"input_ids {bad[:8]} are outside the vocabulary (size {vocab_size})")
    chars = prompt_chars(request)
    if chars > max_prompt_chars:
        raise _refuse(f"the prompt has {chars} characters; this server takes at most {max_prompt_chars} "
                      "(--max-prompt-chars)")


def prompt_chars(request: Generate) -> int:
    if request.messages is not None:
        return sum(len(m.content) + len(m.role) for m in request.messages)
    return len(request.prompt or "")


def prompt_ids(request: Generate, tokenizer: ChatTokenizer) -> list[int]:
    """The prompt's token ids (slow for a long prompt: the frontend calls it off its event loop)."""
    if request.input_ids is not None:
        return list(request.input_ids)
    if request.messages is not None:
        messages = [{"role": m.role, "content": m.content} for m in request.messages]
        try:
            return tokenizer.encode_chat(messages)
        except ChatTemplateError as exc:
            raise _refuse(str(exc)) from None
    return tokenizer.encode(request.prompt or "")


def to_scheduler(request: Generate, rid: str, ids: list[int], model: ModelInfo,
                 defaults: SamplingDefaults = SamplingDefaults()) -> TokenizedRequest:
    if not ids:
        raise _refuse("the prompt tokenizes to no tokens")
    room = model.max_context_tokens - len(ids)
    if room < 1:
        raise Rejected(
            CONTEXT_LENGTH,
            f"the prompt has {len(ids)} tokens; the model's context is {model.max_context_tokens} "
            "tokens and must leave room for at least one generated token",
        )
    top_k = defaults.top_k if request.top_k is None else request.top_k
    return TokenizedRequest(
        rid=rid,
        input_ids=ids,
        sampling=SamplingParams(
            temperature=defaults.temperature if request.temperature is None else request.temperature,
            top_k=min(top_k, model.vocab_size),  # a cut at or past the vocabulary is no cut
            top_p=defaults.top_p if request.top_p is None else request.top_p,
            seed=request.seed,
        ),
        max_tokens=min(request.max_tokens, room),
        eos_token_ids=end_ids(request, model),
        ignore_eos=request.ignore_eos,
        grammar=request.grammar,
    )


def end_ids(request: Generate, model: ModelInfo) -> list[int]:
    """The ids that end ``request``: the model's EOS ids and the request's ``stop_token_ids``."""
    return list(dict.fromkeys([*model.eos_token_ids, *request.stop_token_ids]))
