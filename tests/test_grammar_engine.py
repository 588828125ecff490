"""Constrained decoding through the engine on a tiny random model with a byte-level tokenizer: a
random model writes anything, so every reply that parses and validates is the mask's doing.
Greedy and sampled, alone and batched with unconstrained requests (which must come out as they
would alone), with overlap on and off; a grammar that leaves no token fails its request only."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("llguidance")  # constrained decoding's library; the GPU machines may lack it

from frontend.http.grammars import free_grammar, json_grammar, tool_call_grammar  # noqa: E402
from frontend.http.parsers import ReplyFormat  # noqa: E402
from frontend.http.parsers.json_calls import parse_tool_calls  # noqa: E402
from scheduler.engine import Engine, EngineConfig  # noqa: E402
from scheduler.grammar import GrammarError, Grammars  # noqa: E402
from scheduler.messages.to_scheduler import Grammar, SamplingParams  # noqa: E402
from scheduler.request import Request  # noqa: E402
from tests.fake_scheduler import EOS_ID, SPECIALS, write_byte_tokenizer  # noqa: E402
from tests.test_engine import run  # noqa: E402
from tests.tiny_models import write_tiny  # noqa: E402
from worker.runner import ModelRunner, RunnerConfig  # noqa: E402

VOCAB = 256 + len(SPECIALS)
SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string", "enum": ["Paris", "Lima"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 14},
    "note": {"type": "string", "maxLength": 6},
    "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}},
    "required": ["city", "days", "note", "tags"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["C", "F"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}
PROMPT = list(b"<|user|>\nthe weather as JSON\n<|assistant|>\n")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny-grammar")
    write_tiny(path, "mixtral", seed=3, layers=2, vocab=VOCAB, hidden=64, experts=4, top_k=2)
    write_byte_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def grammars(model_dir) -> Grammars:
    return Grammars.from_dir(model_dir, VOCAB, [EOS_ID])


@pytest.fixture(scope="module")
def runner(model_dir) -> ModelRunner:
    return ModelRunner(RunnerConfig(str(model_dir), device="cpu", dtype="float32", page_size=4, kv_tokens=4096,
                                    max_prefill_tokens=16))


def validate(value, schema: dict) -> None:
    """The subset of JSON Schema these tests use, checked by hand (the GPU machines lack the
    jsonschema package), and by jsonschema too where it is installed."""
    try:
        import jsonschema
    except ImportError:
        jsonschema = None
    if jsonschema is not None:
        jsonschema.validate(value, schema)
    kind = schema.get("type")
    if "enum" in schema:
        assert value in schema["enum"], (value, schema)
    if kind == "object":
        assert isinstance(value, dict) and set(schema["required"]) <= value.keys() <= schema["properties"].keys()
        for key, item in value.items():
            validate(item, schema["properties"][key])
    elif kind == "array":
        assert isinstance(value, list) and len(value) <= schema.get("maxItems", len(value))
        for item in value:
            validate(item, schema["items"])
    elif kind == "string":
        assert isinstance(value, str) and len(value) <= schema.get("maxLength", len(value))
    elif kind == "integer":
        assert type(value) is int and schema.get("minimum", value) <= value <= schema.get("maximum", value)
    elif kind == "boolean":
        assert isinstance(value, bool)


def engine_on(runner: ModelRunner, config: dict) -> Engine:
    """An engine without a prefix cache, so that engines in turn on one runner find its pool whole."""
    return Engine(runner, EngineConfig(prefix_cache=False, **config))


def text(tokens: list[int]) -> str:
    return bytes(t for t in tokens if t < 256).decode("utf-8", errors="replace")


def constrained(rid: str, grammars: Grammars, grammar: Grammar, temperature: float = 0.0, seed: int = 0,
                max_tokens: int = 160) -> Request:
    req = Request(rid, PROMPT, SamplingParams(temperature=temperature, seed=seed), max_tokens, frozenset({EOS_ID}))
    req.grammar = grammars.compile(grammar)
    return req


def free(rid: str, prompt: list[int], max_tokens: int = 20) -> Request:
    return Request(rid, prompt, SamplingParams(), max_tokens, frozenset({EOS_ID}))


@pytest.mark.parametrize("overlap", [True, False])
def test_greedy_and_sampled_replies_parse_and_validate(runner, grammars, overlap):
    grammar = json_grammar(SCHEMA, "response_format json_schema", "response_format")
    reqs = [constrained("greedy", grammars, grammar)]
    reqs += [constrained(f"t{i}", grammars, grammar, temperature=1.0, seed=i) for i in range(6)]
    results = run(engine_on(runner, dict(max_running=8, overlap=overlap)), reqs)
    for rid, (tokens, reason, _) in results.items():
        assert reason == "stop", (rid, text(tokens))
        validate(json.loads(text(tokens)), SCHEMA)
    assert len({text(r[0]) for r in results.values()}) > 2  # sampling still samples


def test_unconstrained_requests_are_neither_changed_nor_held_back(runner, grammars):
    prompts = [list(b"alpha beta"), list(b"one two three four"), list(b"x")]
    alone = run(engine_on(runner, dict(max_running=8)), [free(str(i), p) for i, p in enumerate(prompts)])
    engine = engine_on(runner, dict(max_running=8))
    grammar = json_grammar(SCHEMA, "response_format json_schema", "response_format")
    mixed = [free(str(i), p) for i, p in enumerate(prompts)]
    mixed += [constrained(f"c{i}", grammars, grammar, temperature=1.0, seed=i, max_tokens=200) for i in range(3)]
    steps, seen = 0, {}
    for r in mixed:
        assert engine.submit(r) is None
    while engine.has_work:
        steps += 1
        for u in engine.step():
            seen.setdefault(u.rid, []).extend(u.token_ids)
            if u.finished and u.rid in alone:
                seen[u.rid + ".step"] = steps
    for rid, (tokens, _, _) in alone.items():
        assert seen[rid] == tokens
        assert seen[rid + ".step"] <= len(tokens) + 3  # one step per token (+ prefill, overlap), not two
    for rid in ("c0", "c1", "c2"):
        validate(json.loads(text(seen[rid])), SCHEMA)
    engine.check_pages()


def test_a_forced_tool_call_parses_and_its_arguments_validate(runner, grammars):
    reply = ReplyFormat.of(None, "", {"get_weather": WEATHER["function"]["parameters"]})
    grammar = tool_call_grammar([WEATHER], None, reply, "tool_choice 'required'")
    reqs = [constrained(f"s{i}", grammars, grammar, temperature=1.0, seed=i) for i in range(4)]
    for rid, (tokens, reason, _) in run(engine_on(runner, dict(max_running=4)), reqs).items():
        content, calls = parse_tool_calls(text(tokens))
        assert reason == "stop" and content is None and [c.name for c in calls] == ["get_weather"], text(tokens)
        validate(json.loads(calls[0].arguments), WEATHER["function"]["parameters"])


def test_a_grammar_that_allows_no_token_fails_its_request_only(runner, grammars):
    with pytest.raises(GrammarError, match="test grammar"):
        grammars.compile(Grammar(lark='start: "ok" <[300]>', what="test grammar"))  # no token 300
    engine = engine_on(runner, dict(max_running=4))
    stuck = constrained("stuck", grammars, Grammar(lark='start: "a"', what="test"))
    assert not stuck.grammar.consume_token(ord("z"))  # a matcher in error allows nothing
    results = run(engine, [stuck, free("fine", list(b"abc"))])
    assert results["fine"][1] in ("stop", "length") and results["stuck"] == [[], None, []]
    [failure] = engine.take_failures()  # the matcher's own one-line reason, not a guess
    assert failure.rid == "stuck" and "fails parse" in failure.message and "\n" not in failure.message


def test_tokens_read_before_a_failed_sampling_still_go_out(runner, grammars, monkeypatch):
    """A step with constrained rows reads the step in flight back between its forward and its
    sampling; when the sampling raises, what was read (here the last token of a constrained request,
    which finishes it) is still returned, and only the step's own requests fail."""
    engine = engine_on(runner, dict(max_running=4))
    done = Request("done", list(b"xyz"), SamplingParams(), 1, frozenset({EOS_ID}))  # all prefill in one step
    done.grammar = grammars.compile(Grammar(lark="start: /[a-z]{20}/"))
    more = Request("more", list(b"uvw"), SamplingParams(), 5, frozenset({EOS_ID}))
    more.grammar = grammars.compile(Grammar(lark="start: /[a-z]{20}/"))
    other = free("other", list(b"abc"), 10)
    sample, calls = runner.sample, []

    def second_fails(*args, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("injected")
        return sample(*args, **kw)

    monkeypatch.setattr(runner, "sample", second_fails)
    results = run(engine, [done, more, other])
    assert results["done"][1] == "length" and len(results["done"][0]) == 1
    assert sorted(f.rid for f in engine.take_failures()) == ["more", "other"]
    assert results["other"][1] is None and results["more"][1] is None


@pytest.mark.cuda
def test_constrained_engine_steps_on_the_gpu_launch_without_syncs(model_dir, grammars):
    """Through the decode graphs, every launch (masks filled, copied, applied) under sync debug
    "error"; the replies validate and the unconstrained one is the same as alone."""
    import torch

    runner = ModelRunner(RunnerConfig(str(model_dir), device="cuda", dtype="float32", page_size=16, kv_tokens=4096,
                                      max_prefill_tokens=16))
    runner.graphs.capture_all()
    alone = run(engine_on(runner, dict(max_running=8)), [free("free", list(b"one two three"), 40)])
    engine = engine_on(runner, dict(max_running=8))
    launch = engine._launch

    def strict():
        torch.cuda.set_sync_debug_mode("error")
        try:
            return launch()
        finally:
            torch.cuda.set_sync_debug_mode("default")

    engine._launch = strict
    grammar = json_grammar(SCHEMA, "response_format json_schema", "response_format")
    reqs = [constrained(f"c{i}", grammars, grammar, temperature=1.0 if i else 0.0, seed=i) for i in range(5)]
    results = run(engine, reqs + [free("free", list(b"one two three"), 40)])
    assert results["free"][0] == alone["free"][0]
    for rid in (r.rid for r in reqs):
        tokens, reason, _ = results[rid]
        assert reason == "stop"
        validate(json.loads(text(tokens)), SCHEMA)


AMBIGUOUS = 'start: x "." \nx: x x | x x x | x x x x | /[a-z ]/ | /[a-z ]{2}/ | ""'  # its chart grows every token


def test_a_grammar_past_the_step_limits_fails_its_request_only(runner, grammars):
    """An ambiguous grammar's Earley rows grow with every token, and each step costs more than the
    last (over 0.5 s of mask a step at llguidance's default row limit): under the shared limits it
    fails its own request with llguidance's one-line reason after ~100 tokens, its masks quick, while an
    unconstrained request beside it finishes and every page comes back (``run`` checks them)."""
    import time

    engine = engine_on(runner, dict(max_running=4))
    heavy = constrained("heavy", grammars, Grammar(lark=AMBIGUOUS, what="attack"), max_tokens=400)
    fill, costs = engine.mask.fill, []

    def timed(matchers):
        start = time.perf_counter()
        out = fill(matchers)
        costs.append(time.perf_counter() - start)
        return out

    engine.mask.fill = timed
    results = run(engine, [heavy, free("fine", list(b"abc"), 300)])
    [failure] = engine.take_failures()
    assert failure.rid == "heavy" and not failure.internal and "\n" not in failure.message
    assert "max is 500" in failure.message, failure.message
    assert results["fine"][1] in ("stop", "length") and results["heavy"][1] is None
    assert 50 < len(results["heavy"][0]) < 400 and max(costs[1:]) < 0.2  # the first makes the executor


# ==== llguidance failing inside a call: a Rust panic is a BaseException, not an Exception ====

MAY_REASON = ReplyFormat.of("<think></think>", "<|im_start|>assistant\n", {})


class PanicException(BaseException):
    """pyo3's exception for a Rust panic, as llguidance raises it (``pyo3_runtime.PanicException``)."""


def test_reasoning_the_model_closes_under_a_budget_finishes(runner, grammars):
    """The budgeted reasoning grammar once panicked in llguidance 1.6.1 and 1.9.1 ("num_rows=3
    row_infos=2") computing the mask after the model wrote ``</think`` (a ``stop`` lexeme followed
    by its own closing tag): the reasoning is now whole lexemes, and the request finishes."""
    grammar = free_grammar(None, MAY_REASON, 20, "thinking_token_budget", "thinking_token_budget")
    engine = engine_on(runner, dict(max_running=4))
    thinking = constrained("thinking", grammars, grammar, max_tokens=40)
    assert thinking.grammar.consume_tokens(list(b"<think>hmm</think"))  # the mask after it panicked
    results = run(engine, [thinking, free("fine", list(b"abc"), 30)])
    assert not engine.take_failures()
    tokens, reason, _ = results["thinking"]
    reply = "hmm</think" + text(tokens)  # the model may go on thinking: the tag is closed only once
    assert reason in ("stop", "length") and reply.count("</think>") == 1 and "<think>" not in reply, reply
    assert results["fine"][1] in ("stop", "length")
    assert engine.pages.pool.num_free == engine.pages.pool.capacity and not engine.running


def test_a_raised_panic_in_the_mask_fails_its_request_only(runner, grammars, monkeypatch):
    """When the batched fill raises (here a panic), each row is filled alone: the one that raises
    fails with a one-line reason, its row allows every token, the other constrained request goes on."""
    import llguidance.torch as llt

    grammar = Grammar(lark="start: /[a-z]{20}/", what="test")
    bad, good = constrained("bad", grammars, grammar, max_tokens=20), constrained("good", grammars, grammar, max_tokens=20)
    fill_par, fill_one, rows = llt.fill_next_token_bitmask_par, llt.fill_next_token_bitmask, {}

    def par(executor, matchers, bitmask):
        rows.update(bad=bad.slot)
        if any(row == bad.slot for _, row in matchers):
            bitmask[bad.slot] = 7  # half written, then the panic
            raise PanicException("num_rows=3 row_infos=2\n<backtrace>")
        return fill_par(executor, matchers, bitmask)

    def one(matcher, bitmask, index=0):
        if index == bad.slot:
            raise PanicException("num_rows=3 row_infos=2\n<backtrace>")
        return fill_one(matcher, bitmask, index)

    monkeypatch.setattr(llt, "fill_next_token_bitmask_par", par)
    monkeypatch.setattr(llt, "fill_next_token_bitmask", one)
    engine = engine_on(runner, dict(max_running=4))
    allowed = []
    to_device = engine.mask.to_device
    engine.mask.to_device = lambda: (allowed.append(engine.mask.host[rows["bad"]].tolist()), to_device())[1]
    results = run(engine, [bad, good, free("fine", list(b"abc"), 10)])
    [failure] = engine.take_failures()
    assert failure.rid == "bad" and not failure.internal
    assert failure.message == "PanicException: num_rows=3 row_infos=2 (after 0 tokens)", failure.message
    assert all(w == -1 for w in allowed[0])  # the failed row allows every token, not half of what it had
    assert results["good"][1] == "stop" and len(text(results["good"][0])) == 20
    assert results["fine"][1] in ("stop", "length")
    assert engine.pages.pool.num_free == engine.pages.pool.capacity


def test_a_panic_consuming_a_token_or_compiling_fails_that_request_only(runner, grammars, monkeypatch):
    import llguidance

    engine = engine_on(runner, dict(max_running=4))
    bad = constrained("bad", grammars, Grammar(lark="start: /[a-z]{20}/", what="test"), max_tokens=20)
    accept = Request.accept

    def panics(self, token):
        if self.rid == "bad":
            raise PanicException("consume\n<backtrace>")
        return accept(self, token)

    monkeypatch.setattr(Request, "accept", panics)
    results = run(engine, [bad, free("fine", list(b"abc"), 10)])
    [failure] = engine.take_failures()
    assert failure.rid == "bad" and not failure.internal and "\n" not in failure.message
    assert "PanicException: consume" in failure.message
    assert results["fine"][1] in ("stop", "length") and engine.pages.pool.num_free == engine.pages.pool.capacity

    class Matcher:
        grammar_from_lark = staticmethod(lambda lark: lark)

        def __init__(self, *args, **kw):
            raise PanicException("compile\n<backtrace>")

    monkeypatch.setattr(llguidance, "LLMatcher", Matcher)
    with pytest.raises(GrammarError, match=r"^test: llguidance failed to compile it \(PanicException: compile\)$"):
        grammars.compile(Grammar(lark="start: /[a-z]/", what="test"))
    monkeypatch.undo()
    with pytest.raises(KeyboardInterrupt):  # only llguidance's failures are caught, not an interrupt
        monkeypatch.setattr(Request, "accept", lambda self, token: (_ for _ in ()).throw(KeyboardInterrupt()))
        run(engine_on(runner, dict(max_running=4)), [constrained("x", grammars, Grammar(lark="start: /[a-z]{3}/"))])


def first_mask_imports_nothing() -> None:
    """In a new interpreter: the first constrained step's compile and fill import no module, so the
    loop does not stall on an import (llguidance.torch brings torch._dynamo, seconds)."""
    import sys
    import tempfile

    import torch

    from scheduler.grammar import HostMask

    with tempfile.TemporaryDirectory() as tmp:
        write_byte_tokenizer(Path(tmp))
        grammars = Grammars.from_dir(tmp, VOCAB, [EOS_ID])  # what the scheduler builds beside its loop
    before = set(sys.modules)
    matcher = grammars.compile(Grammar(lark='start: "yes" | "no"', what="test"))
    mask = HostMask(1, VOCAB, torch.device("cpu"))
    assert mask.fill([(matcher, 0)]) == {}
    assert set(sys.modules) <= before, f"the first mask imported {sorted(set(sys.modules) - before)[:8]}"


def test_the_first_constrained_step_imports_nothing():
    from tests.fresh_process import run_fresh

    run_fresh("tests.test_grammar_engine:first_mask_imports_nothing", timeout=120)
