"""The frontend's tokenization of an agent session's prompts (CPU only, no model).

An agent client sends the whole conversation every turn. Each turn here adds a tool result of about
``--turn-tokens`` tokens (the repository's own source files, as a coding agent reads them) and a
short assistant message, up to ``--turns`` turns; the prompt is rendered with the model's chat
template and encoded whole (``tokenizer.encode``, as before) and by ``frontend.prompt_pieces``
(the engine's ``ChatTokenizer.encode_chat``). The bound is encoding the turn's new messages alone
(their rendered text), the least any encoder that must read them does.

    python scripts/bench_prompt_tokenize.py [--tokenizer DIR] [--turns 60] [--turn-tokens 2048]
    python scripts/bench_prompt_tokenize.py --harmony [--turns 60] [--turn-tokens 2048]

Without ``--tokenizer`` the embedded default model's tokenizer and ChatML template (byte-level
BPE as Qwen's). ``--harmony``: gpt-oss's prompts, a Chat request a turn whose assistant reasons and
calls ``read_file`` and whose tool result is the source, rendered by openai-harmony whole and by
``frontend.http.harmony.render`` message by message (needs o200k_base.tiktoken:
``scripts/fetch_o200k.py``).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout, uninstalled

from frontend.tokenizer import ChatTokenizer  # noqa: E402
from scripts.agent_sessions import source_text  # noqa: E402


def tool_texts(tokenizer: ChatTokenizer, tokens: int) -> list[str]:
    """The repository's source (as agent_sessions --text sends it) in chunks of about ``tokens``
    tokens, in a fixed order."""
    text = source_text()
    chars = tokens * 200_000 // len(tokenizer.tokenizer.encode(text[:200_000]).ids)  # tokens x chars a token
    return [text[i:i + chars] for i in range(0, len(text) - chars, chars)]


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def session(tokenizer: ChatTokenizer, args: argparse.Namespace) -> list[tuple[int, float, float, float]]:
    """Per turn: context tokens, seconds whole, seconds by pieces, seconds of the new messages alone."""
    texts = tool_texts(tokenizer, args.turn_tokens)
    messages = [{"role": "system", "content": "You are a coding agent. Read files, run tools, fix the bug."}]
    rows = []
    for turn in range(args.turns):
        new = [{"role": "assistant", "content": f"Reading file {turn}."},
               {"role": "user", "content": texts[turn % len(texts)]}]
        messages += new
        text = tokenizer.render_chat(messages)
        whole = timed(lambda: tokenizer.tokenizer.encode(text, add_special_tokens=False))
        ids: list[int] = []
        pieces = timed(lambda: ids.extend(tokenizer.encode_chat(messages)))
        alone = tokenizer.render_chat(new)
        bound = timed(lambda: tokenizer.tokenizer.encode(alone, add_special_tokens=False))
        rows.append((len(ids), whole, pieces, bound))
    return rows


def harmony_session(args: argparse.Namespace) -> list[tuple[int, float, float, float]]:
    """``session``'s rows for gpt-oss: each turn a reasoned call and its tool result."""
    import msgspec
    from openai_harmony import Conversation

    from frontend.http.harmony import render
    from frontend.http.harmony.encoding import encoding
    from frontend.http.schemas import ChatRequest
    from frontend.kept_ids import KeptIds

    text, kept = source_text(), KeptIds()
    chars = args.turn_tokens * 200_000 // len(encoding().encode(text[:200_000], disallowed_special=()))
    tool = {"type": "function", "function": {"name": "read_file", "description": "a file's text", "parameters": {
        "type": "object", "properties": {"path": {"type": "string"}}}}}
    messages, rows = [{"role": "system", "content": "You are a coding agent. Read files, fix the bug."}], []
    for turn in range(args.turns):
        call = {"id": f"c{turn}", "type": "function", "function": {"name": "read_file",
                                                                   "arguments": f'{{"path": "file{turn}.py"}}'}}
        start = turn * chars % max(len(text) - chars, 1)
        new = [{"role": "assistant", "reasoning_content": f"I should read file {turn}.", "tool_calls": [call]},
               {"role": "tool", "tool_call_id": f"c{turn}", "content": text[start:start + chars]}]
        messages += new
        body = msgspec.convert({"model": "m", "messages": messages}, ChatRequest)
        whole = timed(lambda: render.prompt_ids(body, [tool]))
        ids: list[int] = []
        pieces = timed(lambda: ids.extend(render.prompt_ids(body, [tool], kept=kept)))
        names = {f"c{turn}": "read_file"}
        alone = [h for m in body.messages[-2:] for h in render.conversation_messages(m, names)]
        bound = timed(lambda: encoding().render_conversation(Conversation.from_messages(alone)))
        rows.append((len(ids), whole, pieces, bound))
    return rows


def report(rows: list[tuple[int, float, float, float]], tokenizer_dir: Path | str) -> None:
    print(f"prompt tokenization of one agent session, tokenizer {tokenizer_dir}; bound = encoding the "
          f"turn's new messages alone")
    print(f"{'turns':>9s} {'context':>8s} {'whole ms':>9s} {'pieces ms':>10s} {'bound ms':>9s} {'ratio':>6s}")
    quarter = max(1, len(rows) // 4)
    for first in range(0, len(rows), quarter):
        part = rows[first:first + quarter]
        whole, pieces, bound = (statistics.median(r[i] for r in part) * 1e3 for i in (1, 2, 3))
        print(f"{first + 1:>4d}-{first + len(part):<4d} {part[-1][0]:>8d} {whole:>9.2f} {pieces:>10.2f} "
              f"{bound:>9.2f} {bound / pieces:>6.2f}")
    last = rows[-1]
    print(f"last turn, {last[0]} tokens: whole {last[1] * 1e3:.1f} ms, pieces {last[2] * 1e3:.1f} ms, "
          f"bound {last[3] * 1e3:.1f} ms ({last[3] / last[2]:.2f})")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokenizer", type=Path, default=None, help="directory with tokenizer.json and its template")
    p.add_argument("--turns", type=int, default=60)
    p.add_argument("--turn-tokens", type=int, default=2048, help="tokens of each turn's tool result")
    p.add_argument("--harmony", action="store_true", help="gpt-oss's harmony prompts (openai-harmony)")
    args = p.parse_args()
    if args.harmony:
        report(harmony_session(args), "o200k_harmony (openai-harmony)")
        return
    if args.tokenizer is None:
        from worker.default_model import default_model_dir
        args.tokenizer = default_model_dir()
    tokenizer = ChatTokenizer.from_dir(args.tokenizer)
    print(f"piecewise: {tokenizer.pieces.reason or 'yes'}")
    report(session(tokenizer, args), args.tokenizer)


if __name__ == "__main__":
    main()
