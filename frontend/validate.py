"""Client ``Generate`` -> scheduler ``TokenizedRequest``: tokenize (or render the chat template)
and check the request against the model that the scheduler announced in ``Ready``.

Field ranges (temperature >= 0, 0 < top_p <= 1, top_k >= 0, max_tokens >= 1, non-empty prompt)
are already enforced by the typed decoder of ``frontend.api.requests``. Here: the prompt must
tokenize to at least one token, every id must be in the vocabulary, and the prompt must leave room
for one generated token. ``max_tokens`` is then clamped to the room left (the request ends with
finish_reason "length" there) rather than refused, so a client need not know the context size."""

from __future__ import annotations

from frontend.api.replies import BAD_REQUEST, CONTEXT_LENGTH
from frontend.api.requests import Generate
from frontend.tokenizer import ChatTemplateError, ChatTokenizer
from scheduler.messages.from_scheduler import ModelInfo
from scheduler.messages.to_scheduler import SamplingParams, TokenizedRequest


class Rejected(ValueError):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def prompt_ids(request: Generate, tokenizer: ChatTokenizer, vocab_size: int) -> list[int]:
    if request.input_ids is not None:
        bad = [i for i in request.input_ids if i >= vocab_size]
        if bad:
            raise Rejected(
                BAD_REQUEST, f"input_ids {bad[:8]} are outside the vocabulary (size {vocab_size})"
            )
        return list(request.input_ids)
    if request.messages is not None:
        messages = [{"role": m.role, "content": m.content} for m in request.messages]
        try:
            return tokenizer.encode_chat(messages)
        except ChatTemplateError as exc:
            raise Rejected(BAD_REQUEST, str(exc)) from None
    return tokenizer.encode(request.prompt or "")


def to_scheduler(request: Generate, rid: str, ids: list[int], model: ModelInfo) -> TokenizedRequest:
    if not ids:
        raise Rejected(BAD_REQUEST, "the prompt tokenizes to no tokens")
    room = model.max_context_tokens - len(ids)
    if room < 1:
        raise Rejected(
            CONTEXT_LENGTH,
            f"the prompt has {len(ids)} tokens; the model's context is {model.max_context_tokens} "
            "tokens and must leave room for at least one generated token",
        )
    return TokenizedRequest(
        rid=rid,
        input_ids=ids,
        sampling=SamplingParams(
            temperature=request.temperature,
            top_k=request.top_k,
            top_p=request.top_p,
            seed=request.seed,
        ),
        max_tokens=min(request.max_tokens, room),
        eos_token_ids=list(model.eos_token_ids),
        ignore_eos=request.ignore_eos,
    )
