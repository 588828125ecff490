"""The APIs' constraints as grammars (frontend/http/constrain.py, grammars.py): which request gets
which grammar, the refusals by name (unsupported schema keywords, unsatisfiable or huge schemas,
a tool that is not there, the XML call format), and what the grammars accept, checked with
llguidance on a byte-level tokenizer."""
from __future__ import annotations

import json

import msgspec
import pytest

llguidance = pytest.importorskip("llguidance")  # the GPU machines may lack it

from frontend.http import constrain, grammars  # noqa: E402
from frontend.http.errors import ApiError  # noqa: E402
from frontend.http.parsers import ReplyFormat  # noqa: E402
from frontend.http.schemas import ChatRequest  # noqa: E402
from tests.fake_scheduler import write_byte_tokenizer  # noqa: E402

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
JSON_REPLY = ReplyFormat.of(None, "", {})
XML_TEMPLATE = "<tool_call><function=x><parameter=y>"


def body(**fields) -> ChatRequest:
    return msgspec.convert({"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}, ChatRequest)


def grammar_of(reply: ReplyFormat = JSON_REPLY, **fields):
    b = body(**fields)
    tools = [msgspec.to_builtins(t) for t in b.tools] if b.tools and b.tool_choice != "none" else None
    return constrain.chat_grammar(b, tools, reply)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> llguidance.LLTokenizer:
    path = write_byte_tokenizer(tmp_path_factory.mktemp("tok"))
    return llguidance.LLTokenizer((path / "tokenizer.json").read_text())


def accepts(tokenizer, grammar, text: str) -> bool:
    matcher = llguidance.LLMatcher(tokenizer, llguidance.LLMatcher.grammar_from_lark(grammar.lark))
    return matcher.consume_tokens(tokenizer.tokenize_str(text)) and matcher.is_accepting()


def test_free_output_has_no_grammar():
    assert grammar_of() is None
    assert grammar_of(response_format={"type": "text"}, tools=[WEATHER]) is None
    assert grammar_of(tools=[WEATHER], tool_choice="auto") is None


def test_response_formats(tokenizer):
    obj = grammar_of(response_format={"type": "json_object"})
    assert obj.what == "response_format json_object"
    assert accepts(tokenizer, obj, '{"a": [1, "x"]}') and not accepts(tokenizer, obj, "[1]")
    assert not accepts(tokenizer, obj, '{"a":1}')  # the layout is json.dumps's: no whitespace left free
    schema = grammar_of(response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA,
                                                                                "strict": True}})
    assert accepts(tokenizer, schema, '{"n": 3}') and not accepts(tokenizer, schema, '{"n": "3"}')


def test_forced_calls_and_a_format_with_tools(tokenizer):
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lima"}}\n</tool_call>'
    required = grammar_of(tools=[WEATHER, TIME], tool_choice="required")
    assert accepts(tokenizer, required, call) and not accepts(tokenizer, required, '{"n": 1}')
    assert accepts(tokenizer, required, '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
    named = grammar_of(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert not accepts(tokenizer, named, call) and named.what == "tool_choice 'get_time'"
    assert not accepts(tokenizer, required, call.replace('"Lima"', "7"))  # arguments by the tool's schema
    fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}}
    either = grammar_of(tools=[WEATHER], response_format=fmt)
    assert accepts(tokenizer, either, call) and accepts(tokenizer, either, '{"n": 1}')
    assert grammar_of(tools=[WEATHER], tool_choice="required", response_format=fmt).what == "tool_choice 'required'"


REFUSALS = [
    (dict(response_format={"type": "regex"}), "response_format", "'regex' is not supported"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x"}}), "response_format",
     "needs json_schema.schema"),
    (dict(response_format={"type": "json_schema", "json_schema": {"schema": True}}), "response_format",
     "must be a JSON object"),
    (dict(response_format={"type": "json_schema", "json_schema": {"schema": {
        "type": "object", "properties": {"a": {"type": "array", "contains": {"type": "integer"}}}}}}),
     "response_format", 'Unimplemented keys: ["contains"]'),
    (dict(response_format={"type": "json_schema", "json_schema": {"schema": {
        "type": "integer", "minimum": 5, "maximum": 2}}}), "response_format", "Unsatisfiable schema"),
    (dict(response_format={"type": "json_schema", "json_schema": {"schema": {
        "type": "object", "properties": {f"p{i}": {"type": "string", "pattern": "[a-z]{1,9}@x"} for i in range(8000)}}}}),
     "response_format", "too large"),
    (dict(tool_choice="required"), "tool_choice", "needs tools"),
    (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice",
     "no tool named 'nope'"),
]


@pytest.mark.parametrize("fields, param, match", REFUSALS)
def test_refusals_name_what_is_wrong(fields, param, match):
    with pytest.raises(ApiError) as err:
        grammar_of(**fields)
    assert (err.value.status, err.value.param) == (400, param)
    assert match in str(err.value) and "\n" not in str(err.value)


def test_a_model_that_reasons_first_or_writes_xml_calls_is_refused():
    thinking = ReplyFormat.of("<think></think>", "<|im_start|>assistant\n<think>\n", {})
    with pytest.raises(ApiError, match="reasons first"):
        grammar_of(thinking, response_format={"type": "json_object"})
    with pytest.raises(ApiError, match="XML format"):
        grammar_of(ReplyFormat.of(XML_TEMPLATE, "", {}), tools=[WEATHER], tool_choice="required")


def test_a_client_x_guidance_cannot_loosen_the_layout(tokenizer):
    schema = {**SCHEMA, "x-guidance": {"whitespace_flexible": True}}
    grammar = grammars.json_grammar(schema, "response_format json_schema", "response_format")
    assert json.loads(grammar.lark.split("%json ", 1)[1])["x-guidance"] == grammars.JSON_OPTIONS


# ==== free output held where asked: strict tools left to the model's choice, a reasoning budget ====

STRICT = {"type": "function", "function": {**WEATHER["function"], "strict": True}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lima"}}\n</tool_call>'
OPENED = ReplyFormat.of("<think></think>", "<|im_start|>assistant\n<think>\n", {})  # the prompt opened it
MAY_REASON = ReplyFormat.of("<think></think>", "<|im_start|>assistant\n", {})


def forced_after(tokenizer, grammar, text: str) -> str:
    """What the grammar forces after ``text``."""
    matcher = llguidance.LLMatcher(tokenizer, llguidance.LLMatcher.grammar_from_lark(grammar.lark))
    assert matcher.consume_tokens(tokenizer.tokenize_str(text))
    return tokenizer.decode_str(matcher.compute_ff_tokens())


def test_strict_tools_left_to_choose_hold_a_call_once_it_opens(tokenizer):
    lazy = grammar_of(tools=[STRICT, TIME])
    assert lazy.what == "tools['get_weather'].strict with tool_choice auto"
    assert accepts(tokenizer, lazy, "no call") and accepts(tokenizer, lazy, f"hi {CALL} {CALL}\nbye")
    assert not accepts(tokenizer, lazy, CALL.replace('"Lima"', "7"))
    assert forced_after(tokenizer, lazy, "let me check <tool_call>") == '\n{"name": "get_'
    reasoning = grammar_of(MAY_REASON, tools=[STRICT])  # a call inside reasoning is not a call: free
    assert accepts(tokenizer, reasoning, "<think>maybe <tool_call> x</think>" + CALL)
    with pytest.raises(ApiError, match="XML format"):
        grammar_of(ReplyFormat.of(XML_TEMPLATE, "", {}), tools=[STRICT])


def test_a_thinking_budget_forces_the_end_of_the_reasoning(tokenizer):
    budget = grammar_of(OPENED, thinking_token_budget=20)  # byte tokens: the closing tag is 8 of the 21
    assert accepts(tokenizer, budget, "a" * 12 + "</think>the answer")
    assert not accepts(tokenizer, budget, "a" * 30 + "</think>the answer")
    assert forced_after(tokenizer, budget, "a" * 21) == "</think>"
    may = grammar_of(MAY_REASON, thinking_token_budget=20, tools=[STRICT])  # the model may not reason at all
    assert accepts(tokenizer, may, "no reasoning") and accepts(tokenizer, may, "<think>x</think>" + CALL)
    assert not accepts(tokenizer, may, "<think>" + "a" * 30 + "</think>")
    assert not accepts(tokenizer, may, " <think>" + "a" * 30 + "</think>")  # nor reason past the budget unbounded
    with pytest.raises(ApiError, match="reasons first"):
        grammar_of(OPENED, thinking_token_budget=20, tools=[WEATHER], tool_choice="required")


@pytest.mark.parametrize("budget", [20, None])
def test_the_model_closing_its_reasoning_computes_every_mask(tokenizer, budget):
    """Each mask on the way (llguidance 1.6 and 1.9 panicked after ``</think`` under a ``stop``
    lexeme followed by the tag), the model closing the reasoning itself, then a strict call."""
    import llguidance.torch as llt

    grammar = grammar_of(MAY_REASON, thinking_token_budget=budget, tools=[STRICT])
    matcher = llguidance.LLMatcher(tokenizer, llguidance.LLMatcher.grammar_from_lark(grammar.lark))
    mask = llt.allocate_token_bitmask(1, tokenizer.vocab_size)
    for token in tokenizer.tokenize_str("<think>hmm </thin </think>" + CALL):
        llt.fill_next_token_bitmask(matcher, mask)
        assert not matcher.is_error() and (int(mask[0, token // 32]) >> (token % 32)) & 1, matcher.get_error()
        assert matcher.consume_token(token)
    assert matcher.is_accepting()


@pytest.mark.parametrize("reply, fields, match", [
    (JSON_REPLY, dict(thinking_token_budget=5), "needs a model that reasons"),
    (MAY_REASON, dict(thinking_token_budget=-1), "at least 0"),
])
def test_budget_refusals(reply, fields, match):
    with pytest.raises(ApiError, match=match) as err:
        grammar_of(reply, **fields)
    assert err.value.param == "thinking_token_budget"


def test_the_frontend_and_the_scheduler_read_one_definition_of_the_limits(tmp_path, monkeypatch):
    """``scheduler.messages.grammar_limits`` is the only copy: with its grammar size cut, the
    frontend's check refuses a grammar with a 400 and the scheduler's compile refuses it too."""
    from scheduler.grammar import GrammarError, Grammars
    from scheduler.messages import grammar_limits
    from scheduler.messages.to_scheduler import Grammar
    from tests.fake_scheduler import EOS_ID, SPECIALS

    assert not hasattr(grammars, "LIMITS")
    compiler = Grammars.from_dir(write_byte_tokenizer(tmp_path), 256 + len(SPECIALS), [EOS_ID])
    grammar = grammars.json_grammar(SCHEMA, "response_format", "response_format")
    compiler.compile(grammar)
    assert str(grammar_limits.parser_limits(llguidance)).count("max_items_in_row: 500")
    monkeypatch.setitem(grammar_limits.LIMITS, "max_grammar_size", 5)
    with pytest.raises(ApiError, match="not supported") as err:
        grammars.json_grammar(SCHEMA, "response_format", "response_format")
    assert err.value.status == 400
    with pytest.raises(GrammarError, match="grammar"):
        compiler.compile(grammar)


def test_a_limit_field_an_older_llguidance_lacks_is_left_out():
    from scheduler.messages import grammar_limits

    class Old:  # llguidance without step_max_items
        class LLParserLimits:
            max_items_in_row = initial_lexer_fuel = step_lexer_fuel = max_lexer_states = max_grammar_size = None

            def __init__(self, **fields):
                self.fields = fields

    assert set(grammar_limits.parser_limits(Old).fields) == set(grammar_limits.LIMITS) - {"step_max_items"}


def test_a_panic_checking_a_grammar_is_a_400_not_a_dead_server(monkeypatch):
    """A Rust panic in llguidance comes as pyo3's PanicException, a BaseException: the check turns
    it into the API's error, with one line of why."""
    class PanicException(BaseException):
        pass

    def panics(*args, **kw):
        raise PanicException("num_rows=3 row_infos=2\n<backtrace>")

    monkeypatch.setattr(llguidance.LLMatcher, "validate_grammar_with_warnings", panics)
    with pytest.raises(ApiError, match=r"llguidance failed on it \(PanicException: num_rows=3 row_infos=2\)$") as err:
        grammar_of(response_format={"type": "json_object"})
    assert err.value.status == 400 and err.value.param == "response_format"
