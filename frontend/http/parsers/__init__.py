"""Reply parsers: a model's text, whole or streamed in pieces of any size, as content, reasoning
and tool calls, in the markup that the model's chat template teaches it (``template_markup``):

- calls as Hermes / Qwen2.5 / Qwen3 JSON, ``<tool_call>{"name": ..., "arguments": ...}</tool_call>``
  (``json_calls``, the default), or as Qwen3-Coder / Qwen3.5 XML, ``<tool_call><function=NAME>
  <parameter=ARG>VALUE</parameter></function></tool_call>``, values typed by the tool's schema
  (``xml_calls``);
- ``<think>...</think>`` as reasoning (``reasoning``), also when the template opened ``<think>``
  at the end of the prompt; a call inside reasoning is reasoning, not a call.

An API's adapter takes one ``ReplyFormat`` per request (``frontend.http.convert.reply_format`` for a
Chat body: the template, the prompt's tail, the tools' schemas; no tools, no calls parsed), and
from it ``whole(text)`` (content, calls, reasoning) or a stream parser per reply. A stream
parser's events are ``ToolCallStream``'s, ``str`` content and a ``ParsedCall`` as each call
closes; ``parser(reasoning=True)`` adds ``Reasoning`` pieces (else reasoning is left out) and
``parser(stream_arguments=True)`` a ``CallStart`` and ``CallArguments`` pieces before each
``ParsedCall``.

Switching from ``frontend.http.tool_calls`` is one line where the parser is made::

    ToolCallStream() if tools else None   ->   reply.parser()
    parse_tool_calls(text)                ->   reply.whole(text)[:2]

given ``reply = convert.reply_format(chat_body, generate.input_ids, tokenizer)`` where the request
is converted, in place of the ``tools`` flag; then opt into reasoning and argument deltas.

May import: the standard library only (no other part of Sluice)."""

from frontend.http.parsers.events import CallArguments, CallStart, Event, ParsedCall, Reasoning
from frontend.http.parsers.reply import Reply, ReplyFormat, ReplyParser, TemplateMarkup, template_markup

__all__ = ["CallArguments", "CallStart", "Event", "ParsedCall", "Reasoning", "Reply", "ReplyFormat",
           "ReplyParser", "TemplateMarkup", "template_markup"]
