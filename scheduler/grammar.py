"""Constrained decoding on the scheduler's side, with llguidance (chosen by measurement:
docs/architecture.md, "Constrained decoding"): a request's ``Grammar`` compiles against the
model's tokenizer into a matcher; before each step that samples for the request, the matcher
fills the request's row of the host mask; each token read back is consumed, and a complete
grammar finishes the request.

```
 host (pinned) words [max_running, ceil(V/32)] int32   row = the request's token-buffer row
   fill rows of the step's constrained requests (one call, llguidance's threads, GIL released)
   -> one non-blocking copy into the device words -> worker.token_mask in sampling (and graphs)
```

The host rows are written only when no step that reads them is in flight: the engine reads a
masked step's tokens before it launches the next (a constrained request needs them anyway).
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import torch

from scheduler.messages.grammar_limits import parser_limits
from scheduler.messages.to_scheduler import Grammar
from worker.token_mask import mask_words

if TYPE_CHECKING:  # imported when the first constrained request comes: serving needs it for nothing else
    import llguidance


class GrammarError(ValueError):
    """A grammar that does not compile, or that allows no token."""


def library_failure(exc: BaseException) -> bool:
    """Whether ``exc``, raised by an llguidance call, is the library's failure: any Exception, or a
    Rust panic, which pyo3 raises as ``PanicException``, a BaseException (``except Exception`` misses it)."""
    return isinstance(exc, Exception) or type(exc).__name__ == "PanicException"


def one_line(exc: BaseException) -> str:
    """``exc`` as one line: its first (a panic's message is followed by a backtrace)."""
    return f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}"


def _read_tokenizer(llguidance, tokenizer_json: str, vocab: int, eos_ids: list[int]):
    """Newer llguidance takes every end-of-turn id; older releases (1.6) take one, and then a grammar
    ends its text on the first id only (the others stay masked where the grammar is complete)."""
    try:
        return llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab, eos_token=eos_ids or None)
    except TypeError:
        return llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab, eos_token=eos_ids[0] if eos_ids else None)


class Grammars:
    """The model's tokenizer as llguidance reads it (its ids padded to the model's vocabulary),
    and the compiler of requests' grammars."""

    def __init__(self, tokenizer_json: str, vocab: int, eos_ids: Sequence[int]):
        try:
            import llguidance
            # the mask's torch helpers import torch._dynamo (1.8 s here): imported now, beside the loop
            # (``scheduler.server`` builds this in a thread), not at the first constrained step
            import llguidance.torch  # noqa: F401
        except ImportError:
            raise GrammarError("constrained decoding needs the llguidance package (pip install llguidance)") from None
        try:
            self.tokenizer = _read_tokenizer(llguidance, tokenizer_json, vocab, list(eos_ids))
        except Exception as exc:  # whatever the library raises for a tokenizer it cannot read
            raise GrammarError(f"constrained decoding cannot read this model's tokenizer: {exc}") from None
        self.vocab = vocab

    @classmethod
    def from_dir(cls, tokenizer_dir: str | Path, vocab: int, eos_ids: Sequence[int]) -> Grammars:
        try:
            text = (Path(tokenizer_dir) / "tokenizer.json").read_text()
        except OSError as exc:
            raise GrammarError(f"constrained decoding needs the model's tokenizer.json: {exc}") from None
        return cls(text, vocab, eos_ids)

    def compile(self, grammar: Grammar) -> llguidance.LLMatcher:
        """A fresh matcher for ``grammar``, or GrammarError naming what is wrong with it."""
        import llguidance

        try:
            matcher = llguidance.LLMatcher(self.tokenizer, llguidance.LLMatcher.grammar_from_lark(grammar.lark),
                                           log_level=0, limits=parser_limits(llguidance))
        except BaseException as exc:
            if not library_failure(exc):
                raise
            raise GrammarError(f"{grammar.what}: llguidance failed to compile it ({one_line(exc)})") from None
        if matcher.is_error():
            raise GrammarError(f"{grammar.what}: {matcher.get_error()}")
        return matcher


class HostMask:
    """The step's grammar mask: a pinned host row per token-buffer row, and its device copy."""

    def __init__(self, rows: int, vocab: int, device: torch.device):
        cuda = device.type == "cuda"
        self.host = torch.zeros(rows, mask_words(vocab), dtype=torch.int32, pin_memory=cuda)
        self.device_words = torch.zeros_like(self.host, device=device) if cuda else self.host
        self.executor: llguidance.LLExecutor | None = None

    def fill(self, matchers: list[tuple[llguidance.LLMatcher, int]]) -> dict[int, str]:
        """Fill the rows of ``(matcher, row)``; returns the rows their grammar leaves no token in, each
        with the one-line error of an llguidance call that raised for it (a Rust panic too), else ""."""
        import llguidance
        import llguidance.torch as llt

        self.executor = self.executor or llguidance.LLExecutor()
        try:
            llt.fill_next_token_bitmask_par(self.executor, matchers, self.host)
            raised = {}
        except BaseException as exc:
            if not library_failure(exc):
                raise
            raised = self._fill_each(matchers)  # the batch call names no matcher: each row again, alone
        return {row: raised.get(row, "") for m, row in matchers
                if row in raised or m.is_error() or not bool(self.host[row].any())}

    def _fill_each(self, matchers: list[tuple[llguidance.LLMatcher, int]]) -> dict[int, str]:
        """Fill each row by itself; returns the rows whose call raised (left allowing nothing), with why."""
        import llguidance.torch as llt

        raised = {}
        for matcher, row in matchers:
            try:
                llt.fill_next_token_bitmask(matcher, self.host, row)
            except BaseException as exc:
                if not library_failure(exc):
                    raise
                self.host[row] = 0  # never a half-written row: the engine fails it and allows every token there
                raised[row] = one_line(exc)
        return raised

    def allow_all(self, rows: list[int]) -> None:
        self.host[rows] = -1  # every bit set

    def to_device(self) -> torch.Tensor:
        """The words on the device (one non-blocking copy on CUDA)."""
        if self.device_words is not self.host:
            self.device_words.copy_(self.host, non_blocking=True)
        return self.device_words
