"""OpenAI request bodies as msgspec Structs: decoding one checks every field's type, so a wrong
type is a 400 before anything else runs. A body's unknown fields are refused by name (a field
Sluice does not know might change the output), inside its objects they are ignored (clients echo
back message fields such as ``refusal``). Fields that do not change the output are accepted;
the ones that would and that Sluice does not implement are declared so that ``convert`` can
refuse them with a reason."""

from __future__ import annotations

from typing import Any, Literal, Union

import msgspec


class _Body(msgspec.Struct, kw_only=True):
    pass


class FunctionDef(_Body, kw_only=True, omit_defaults=True):  # the template sees only what was sent
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Body, kw_only=True):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Body, kw_only=True):
    name: str


class NamedToolChoice(_Body, kw_only=True):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Union[Literal["none", "auto", "required"], NamedToolChoice]


class CalledFunction(_Body, kw_only=True):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Body, kw_only=True):
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class ContentPart(_Body, kw_only=True):
    type: str  # "text" only: other kinds (image_url, input_audio, ...) are refused by name in convert
    text: str | None = None


class Message(_Body, kw_only=True):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    reasoning_content: str | None = None  # an earlier reply's, for templates that show it again
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


class StreamOptions(_Body, kw_only=True):
    include_usage: bool = False


class _Sampling(_Body, kw_only=True, forbid_unknown_fields=True):
    """Fields both endpoints share. ``None`` means "not given": the internal default applies."""

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # not OpenAI's, but vLLM's and SGLang's; agents send it
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    # Accepted: they do not change the output.
    user: str | None = None
    safety_identifier: str | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None  # false only: Sluice keeps no completions
    prompt_cache_key: str | None = None  # Sluice's prefix cache needs no key
    service_tier: str | None = None
    # Declared only to be refused when set (convert.check_request): Sluice does not implement them.
    logprobs: bool | int | None = None
    top_logprobs: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_p: float | None = None
    logit_bias: dict[str, float] | None = None
    response_format: dict[str, Any] | None = None
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    guided_decoding_backend: Any = None
    guided_whitespace_pattern: Any = None


class ChatRequest(_Sampling, kw_only=True):
    messages: list[Message]
    max_completion_tokens: int | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None  # accepted; the model decides how many calls it makes
    chat_template_kwargs: dict[str, Any] | None = None  # more variables for the template
    reasoning_effort: str | None = None  # "none" only, where the template reads enable_thinking
    thinking_token_budget: int | None = None  # vLLM's name: the reasoning ends within this many tokens


class CompletionRequest(_Sampling, kw_only=True):
    prompt: str | list[str | int]  # text, one text in a list, or token ids
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None
