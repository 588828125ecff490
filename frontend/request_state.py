"""One live request in the frontend: turns the scheduler's token updates into client chunks
(detokenize, strip EOS, stop strings, usage), streaming or all at the end."""

from __future__ import annotations

import time
from typing import Sequence

from frontend.api.replies import Chunk, FinishReason, Usage
from frontend.detokenize import IncrementalDetokenizer
from frontend.stops import StopMatcher
from frontend.tokenizer import ChatTokenizer
from scheduler.messages.from_scheduler import TokenUpdate


class RequestState:
    def __init__(
        self,
        *,
        envelope: list[bytes],
        client_rid: str,
        tokenizer: ChatTokenizer,
        prompt_ids: Sequence[int],
        stream: bool,
        stop: Sequence[str],
        eos_token_ids: Sequence[int],
    ) -> None:
        self.envelope = envelope  # ZMQ routing frames of the client that sent the request
        self.client_rid = client_rid
        self.stream = stream
        self._eos = frozenset(eos_token_ids)
        self._detok = IncrementalDetokenizer(tokenizer.decode, prompt_ids)
        self._stops = StopMatcher(stop)
        self._prompt_tokens = len(prompt_ids)
        self._cached_tokens = 0
        self._token_ids: list[int] = []  # for a non-streaming reply, all of them
        self._text: list[str] = []  # likewise
        self.completion_tokens = 0
        self.started_s = time.monotonic()  # for the latency metrics
        self.last_token_s: float | None = None

    def on_update(self, update: TokenUpdate) -> Chunk | None:
        """The chunk to send for this update (None: nothing yet, non-streaming). When the chunk
        has a finish_reason but ``update.finished`` is false, a stop string ended the request and
        the scheduler must be told to abort it."""
        self._cached_tokens = update.cached_prompt_tokens
        self.completion_tokens += len(update.token_ids)
        ids = update.token_ids
        # The EOS that ended the request is reported as an id but never becomes text.
        ended_by_eos = update.finish_reason == "stop" and ids and ids[-1] in self._eos
        text, stopped = self._stops.feed(self._detok.step(ids[:-1] if ended_by_eos else ids))
        reason: FinishReason | None = "stop" if stopped else update.finish_reason
        if reason is not None and not stopped:
            tail, stopped = self._stops.feed(self._detok.flush())
            text += tail if stopped else tail + self._stops.flush()
            reason = "stop" if stopped else reason
        return self._emit(text, list(ids), reason)

    def finish(self, reason: FinishReason) -> Chunk:
        """End the request from the frontend's side (client abort): release held text."""
        tail, stopped = self._stops.feed(self._detok.flush())
        text = tail if stopped else tail + self._stops.flush()
        chunk = self._emit(text, [], reason)
        assert chunk is not None
        return chunk

    def _emit(self, text: str, ids: list[int], reason: FinishReason | None) -> Chunk | None:
        usage = None
        if reason is not None:
            usage = Usage(
                prompt_tokens=self._prompt_tokens,
                completion_tokens=self.completion_tokens,
                cached_prompt_tokens=self._cached_tokens,
            )
        matched = self._stops.matched if reason == "stop" else None
        if self.stream:
            return Chunk(rid=self.client_rid, text=text, token_ids=ids, finish_reason=reason,
                         usage=usage, matched_stop=matched)
        self._text.append(text)
        self._token_ids.extend(ids)
        if reason is None:
            return None
        return Chunk(
            rid=self.client_rid,
            text="".join(self._text),
            token_ids=self._token_ids,
            finish_reason=reason,
            usage=usage,
            matched_stop=matched,
        )
