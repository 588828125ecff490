"""A chat prompt tokenized piece by piece, each piece's ids kept: an agent client resends the whole
conversation every turn, and encoding its 130k tokens again took about 126 ms of a core, against
7 ms by pieces (``scripts/bench_prompt_tokenize.py`` on a 2-core CPU machine), while only the new
messages are new text.

The rendered prompt is cut at the tokenizer's added tokens that are matched on the raw text
(``<|im_start|>``, ``<|im_end|>``, ...: ``normalized: false``). ``tokenizers`` itself splits those
out first (leftmost, longest), then normalizes, pre-tokenizes and runs the model on each piece
between them alone (the other added tokens are found inside a piece, after normalizing), so the
pieces' ids, encoded one by one and joined with the added tokens' ids, are the ids of the whole
text. Three things break that, and with any of them the prompt is encoded whole as before: an added
token with ``lstrip``/``rstrip``/``single_word`` (it looks at the text beside it), a Metaspace
pre-tokenizer with ``prepend_scheme: first`` (it treats the piece at offset 0 differently,
Mixtral's tokenizer), and ``encode_special_tokens`` set on the tokenizer (special tokens read as
text). ``tests/test_prompt_pieces.py`` checks the joined ids against whole encodings.

The kept pieces are the long ones (short ones cost less to encode than to look up), in a
``KeptIds`` (an LRU bounded by memory)."""

from __future__ import annotations

import json
import re

import tokenizers

from frontend.kept_ids import KeptIds

MIN_CACHED_CHARS = 256


def piecewise_reason(tokenizer: tokenizers.Tokenizer) -> str | None:
    """Why this tokenizer's prompts cannot be encoded piece by piece, or None when they can."""
    for token in tokenizer.get_added_tokens_decoder().values():
        if token.lstrip or token.rstrip or token.single_word:
            return f"added token {token.content!r} is matched with lstrip/rstrip/single_word"
    for part in ("normalizer", "pre_tokenizer"):
        component = getattr(tokenizer, part)
        spec = json.loads(component.__getstate__()) if component is not None else None  # its tokenizer.json entry
        if '"prepend_scheme": "first"' in json.dumps(spec):
            return f"the {part} prepends to the first piece only (prepend_scheme first)"
    return None


class PromptPieces:
    """``encode(text)``: the ids of ``text`` as ``tokenizer.encode(text, add_special_tokens=False)``
    gives them, from kept pieces where it can. Thread-safe (the frontend encodes on worker threads)."""

    def __init__(self, tokenizer: tokenizers.Tokenizer, kept: KeptIds | None = None) -> None:
        self.tokenizer = tokenizer
        self.kept = kept if kept is not None else KeptIds()
        self.reason = piecewise_reason(tokenizer)  # None: piecewise
        added = {t.content: i for i, t in tokenizer.get_added_tokens_decoder().items() if not t.normalized}
        self._added = added
        # longest first: at one position the regex takes the first alternative, tokenizers the longest
        names = sorted(added, key=len, reverse=True)
        self._split = re.compile("(" + "|".join(map(re.escape, names)) + ")").split if names else None

    def encode(self, text: str) -> list[int]:
        # encode_special_tokens (settable at any time) encodes special tokens' text as text: no pieces
        if self.reason is not None or self._split is None or self.tokenizer.encode_special_tokens:
            return self._encode_all([text])[0]
        parts = self._split(text)  # text, added token, text, added token, ..., text
        pieces = parts[0::2]
        found = self.kept.lookup(pieces, MIN_CACHED_CHARS)
        missing = list(dict.fromkeys(p for p, ids in zip(pieces, found) if ids is None and p))
        fresh = dict(zip(missing, self._encode_all(missing)))
        self.kept.keep(fresh.items(), MIN_CACHED_CHARS)
        out: list[int] = []
        for i, part in enumerate(parts):
            if i % 2:
                out.append(self._added[part])
            elif part:
                out.extend(found[i // 2] if found[i // 2] is not None else fresh[part])
        return out

    def _encode_all(self, texts: list[str]) -> list[list[int]]:
        # encode_batch releases the GIL (encode does not) and runs the texts in parallel
        return [e.ids for e in self.tokenizer.encode_batch(texts, add_special_tokens=False)] if texts else []
