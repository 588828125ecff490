"""A stand-in for ``python -m scheduler`` that speaks ``scheduler.messages`` with no model, for the
frontend tests; and the tiny byte-level tokenizer (token id = byte value) it announces.

Each step, every running request gets its next token: it echoes its prompt ids one by one, then
samples EOS (finish "stop"); with ignore_eos it echoes again from the start. ``max_tokens`` ends it
with "length". A prompt starting with ``--hang-id`` gets one token and then nothing until it is
aborted; one starting with ``--reject-id`` gets a RequestError. Stats expose what it received,
so tests can check aborts and passthrough args."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import zmq

from scheduler.messages import from_scheduler as F
from scheduler.messages import to_scheduler as T

EOS_ID = 256
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for m in messages %}"
    "{% if m['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + m['role']) }}{% endif %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _bytes_to_unicode() -> dict[int, str]:
    # GPT-2's printable stand-ins for the 256 byte values, as ByteLevel expects.
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def write_byte_tokenizer(path: str | Path, chat_template: str = CHATML) -> Path:
    """Writes tokenizer.json (256 byte tokens + SPECIALS) and tokenizer_config.json (ChatML)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True) for s in SPECIALS])
    tok.save(str(path / "tokenizer.json"))
    config = {"chat_template": chat_template, "eos_token": "<|endoftext|>", "bos_token": None}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


class FakeScheduler:
    def __init__(self, args: argparse.Namespace, engine_args: list[str]) -> None:
        self.args = args
        self.ctx = zmq.Context()
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.connect(args.frontend_to_scheduler)
        self.push = self.ctx.socket(zmq.PUSH)
        self.push.connect(args.scheduler_to_frontend)
        self.running: dict[str, tuple[T.TokenizedRequest, list[int]]] = {}
        self.stats: dict[str, F.StatValue] = {
            "requests_total": 0,
            "aborts_total": 0,
            "last_abort": None,
            "last_max_tokens": None,
            "last_temperature": None,
            "last_grammar": None,  # the lark text of the last request's grammar (the fake never applies it)
            "engine_args": " ".join(engine_args),
        }

    def send(self, message: F.FromScheduler) -> None:
        self.push.send(F.encode(message))

    def run(self) -> int:
        model = F.ModelInfo(
            name="fake",
            tokenizer_path=self.args.tokenizer_path,
            max_context_tokens=self.args.max_context,
            vocab_size=EOS_ID + len(SPECIALS),
            eos_token_ids=[EOS_ID],
        )
        self.send(F.Ready(pid=os.getpid(), model=model))
        next_step = next_beat = time.monotonic()
        while True:
            timeout_ms = max(0, int(1000 * (min(next_step, next_beat) - time.monotonic())))
            if self.pull.poll(timeout_ms):
                if not self.on_message(T.decode(self.pull.recv())):
                    return 0
            now = time.monotonic()
            if now >= next_beat:
                self.send(F.Heartbeat(pid=os.getpid(), time=time.time()))
                next_beat = now + 0.2
            if now >= next_step:
                self.step()
                next_step = now + self.args.step_delay

    def on_message(self, message: T.ToScheduler) -> bool:
        if isinstance(message, T.TokenizedRequest):
            self.running[message.rid] = (message, [])
            self.stats["requests_total"] += 1
            self.stats["last_max_tokens"] = message.max_tokens
            self.stats["last_temperature"] = message.sampling.temperature
            self.stats["last_grammar"] = message.grammar.lark if message.grammar is not None else None
            if message.input_ids[0] == self.args.reject_id:
                del self.running[message.rid]
                self.send(
                    F.RequestError(rid=message.rid, message="fake scheduler rejects this prompt")
                )
        elif isinstance(message, T.AbortRequest):
            self.stats["aborts_total"] += 1
            self.stats["last_abort"] = message.rid
            self.running.pop(message.rid, None)
        elif isinstance(message, T.StatsRequest):
            self.send(
                F.StatsReply(
                    nonce=message.nonce, stats={**self.stats, "running": len(self.running)}
                )
            )
        else:
            return False  # Shutdown
        return True

    def step(self) -> None:
        updates = []
        for rid, (req, out) in list(self.running.items()):
            n = len(out)
            if req.input_ids[0] == self.args.hang_id and n > 0:
                continue
            echo_done = n >= len(req.input_ids) and not req.ignore_eos
            token = EOS_ID if echo_done else req.input_ids[n % len(req.input_ids)]
            out.append(token)
            reason = "stop" if echo_done else "length" if len(out) >= req.max_tokens else None
            updates.append(
                F.TokenUpdate(
                    rid=rid,
                    token_ids=[token],
                    finished=reason is not None,
                    finish_reason=reason,
                    prompt_tokens=len(req.input_ids),
                    cached_prompt_tokens=min(2, len(req.input_ids)),
                )
            )
            if reason is not None:
                del self.running[rid]
        if updates:
            self.send(F.TokenBatch(updates=updates))


def main() -> int:
    p = argparse.ArgumentParser(allow_abbrev=False)
    p.add_argument("--frontend-to-scheduler", required=True)
    p.add_argument("--scheduler-to-frontend", required=True)
    p.add_argument("--tokenizer-path", required=True)
    p.add_argument("--max-context", type=int, default=64)
    p.add_argument("--step-delay", type=float, default=0.005)
    p.add_argument(
        "--reject-id", type=int, default=-1, help="first prompt id that gets a RequestError"
    )
    p.add_argument(
        "--hang-id", type=int, default=-1, help="first prompt id that hangs after one token"
    )
    p.add_argument("--fail-start", action="store_true", help="exit 3 before Ready")
    p.add_argument("--ready-delay", type=float, default=0.0, help="seconds of 'loading' before Ready")
    args, engine_args = p.parse_known_args()
    if args.fail_start:
        print("fake scheduler: failing on purpose", file=sys.stderr)
        return 3
    time.sleep(args.ready_delay)
    scheduler = FakeScheduler(args, engine_args)
    try:
        return scheduler.run()
    finally:
        scheduler.ctx.destroy(linger=0)


if __name__ == "__main__":
    sys.exit(main())
