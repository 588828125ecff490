"""Token ids of texts the frontend met before, kept so that an agent's history is not tokenized
again every turn: an LRU bounded by memory (a key's characters and 4 bytes an id: a text of long
runs of spaces has many characters a token, so tokens alone would not bound it). Chat-template
prompts keep their pieces in one (``frontend.prompt_pieces``), gpt-oss's harmony prompts their
rendered messages in another (``frontend.http.harmony.render``): the tokenizer owns both."""

from __future__ import annotations

import threading
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence

CACHE_BYTES = 64 << 20  # about 60 sessions of 128k tokens (3.5 characters and a 4-byte id a token)


class KeptIds:
    """``lookup`` and ``keep`` by text; thread-safe (the frontend tokenizes on worker threads)."""

    def __init__(self, max_bytes: int = CACHE_BYTES) -> None:
        self.max_bytes = max_bytes
        self._kept: OrderedDict[str, array] = OrderedDict()
        self._lock = threading.Lock()
        self.tokens = self.bytes = 0  # kept ids, and their keys' cost (``cost``)
        self.hits = self.misses = 0  # keys found / kept
        self.reused_tokens = 0  # prompt tokens taken from here, not tokenized again

    def lookup(self, keys: Sequence[str], min_chars: int = 0) -> list[array | None]:
        """Each key's ids, or None (keys shorter than ``min_chars`` are not looked for)."""
        with self._lock:
            found = [self._kept.get(k) if len(k) >= min_chars else None for k in keys]
            for k, ids in zip(keys, found):
                if ids is not None:
                    self._kept.move_to_end(k)
                    self.hits += 1
                    self.reused_tokens += len(ids)
            return found

    def keep(self, fresh: Iterable[tuple[str, list[int]]], min_chars: int = 0) -> None:
        """Keep each ``(key, ids)`` (keys shorter than ``min_chars`` not), dropping the least
        recently used past ``max_bytes``."""
        with self._lock:
            for key, ids in fresh:
                if len(key) < min_chars or cost(key, ids) > self.max_bytes or key in self._kept:
                    continue
                self._kept[key] = array("i", ids)
                self.tokens += len(ids)
                self.bytes += cost(key, ids)
                self.misses += 1
            while self.bytes > self.max_bytes:
                key, dropped = self._kept.popitem(last=False)
                self.tokens -= len(dropped)
                self.bytes -= cost(key, dropped)


def cost(key: str, ids) -> int:
    """A kept entry's memory, near enough: its key's characters (a byte each in ASCII) and 4 bytes an id."""
    return len(key) + 4 * len(ids)
