"""A request's life in the scheduler, as the host sees it.

A request prefills its first ``prefill_len`` tokens of ``prompt + output`` (the prompt; after a
preemption also the outputs so far, whose KV went back to the prefix cache), then decodes, taking
KV pages as its sequence grows.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from scheduler.radix_cache import PrefixMatch
from scheduler.messages.to_scheduler import SamplingParams

if TYPE_CHECKING:
    import torch
    from llguidance import LLMatcher


@dataclass
class Request:
    rid: str
    prompt: list[int]
    sampling: SamplingParams
    max_tokens: int
    eos_ids: frozenset[int]
    ignore_eos: bool = False
    output: list[int] = field(default_factory=list)  # tokens read back from the device
    pages: list[int] = field(default_factory=list)  # page table: prefix pages, then own pages
    prefix: PrefixMatch | None = None  # the locked radix match the first pages came from
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    prefill_len: int = -1  # tokens of prompt + output to prefill before decoding; -1: the prompt
    prefilled: int = 0  # of those, tokens whose KV is written (or launched)
    launched_outputs: int = 0  # output tokens whose sampling has been launched
    kv_ready: torch.cuda.Event | None = None  # page copies its first chunk must wait for (KV tier)
    slot: int = -1  # row of the device token buffer
    # hybrid models: state snapshots taken for the prefix cache, as (position, snapshot slot), waiting
    # for the request's pages to enter the tree; and the radix node whose snapshot it resumes from
    snapshots: list[tuple[int, int]] = field(default_factory=list)
    resume_from: object | None = None
    # gpt-oss: the sliding layers' page table into the window pool (scheduler.window_cache)
    window_pages: list[int] = field(default_factory=list)
    sent_first: bool = False
    finished: bool = False
    preempted: bool = False  # gave its pages back to make room; waits to be admitted again
    preemptions: int = 0
    # constrained decoding: the grammar's matcher (scheduler.grammar); the request samples only what
    # it allows, never a step ahead of its last token, and finishes when it is complete
    grammar: LLMatcher | None = None

    def __post_init__(self):
        if self.prefill_len < 0:
            self.prefill_len = len(self.prompt)

    @property
    def own_pages(self) -> list[int]:
        """Pages this request allocated (the rest belong to the radix cache)."""
        return self.pages[self.prefix.num_pages if self.prefix else 0:]

    @property
    def prefill_done(self) -> bool:
        return self.prefilled == self.prefill_len

    @property
    def prefill_tokens(self) -> list[int]:
        return (self.prompt + self.output)[:self.prefill_len]

    @property
    def kv_written(self) -> int:
        """Tokens whose KV is written or launched: decoding output j writes token j - 1's."""
        return len(self.prompt) + self.launched_outputs - 1 if self.prefill_done else self.prefilled

    @property
    def kv_tokens(self) -> list[int]:
        """The tokens of ``kv_written`` (known on the host: only the last launched one may not be)."""
        return (self.prompt + self.output)[:self.kv_written]

    def requeue(self) -> None:
        """After a preemption: prefill everything known again (mostly from the prefix cache)."""
        self.prefill_len = len(self.prompt) + len(self.output)
        self.prefilled, self.preempted = 0, False

    @property
    def wants_decode(self) -> bool:
        return self.prefill_done and self.launched_outputs < self.max_tokens and not self.finished

    def accept(self, token: int) -> bool:
        """Append a token read back; False when the request's grammar refuses it."""
        self.output.append(token)
        return self.grammar is None or self.grammar.consume_token(token)

    def finish_reason(self) -> str | None:
        if self.output and self.output[-1] in self.eos_ids and not self.ignore_eos:
            return "stop"
        if self.grammar is not None and self.grammar.is_stopped():
            return "stop"
        if len(self.output) >= self.max_tokens:
            return "length"
        return None
