"""The endpoints: parse the body, convert it, submit it as a local client of the Frontend, and
answer whole or as a stream."""

from __future__ import annotations

import asyncio
from typing import Awaitable, AsyncIterator, TypeVar

import msgspec
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from frontend.api import requests
from frontend.http import chat, completions, constrain, convert, responses_api, responses_reply, sse
from frontend.http import messages_api, messages_objects, messages_reply
from frontend.http import responses as r
from frontend.http.context import HttpContext
from frontend.http.errors import ApiError
from frontend.http.harmony.encoding import speaks_harmony
from frontend.http.schemas import ChatRequest, CompletionRequest
from frontend.http.session import Session

STATS_TIMEOUT_S = 10.0
B = TypeVar("B")
T = TypeVar("T")


def _ctx(request: Request) -> HttpContext:
    return request.app.state.ctx


def json_response(body: object, status: int = 200) -> Response:
    return Response(msgspec.json.encode(body), status, media_type="application/json")


async def read_body(request: Request, type_: type[B], limit: int) -> B:
    """The JSON body decoded as ``type_``; oversized, malformed and mistyped bodies are 4xx."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"the request body is larger than {limit} bytes")
    data = bytearray()
    async for part in request.stream():
        data += part
        if len(data) > limit:
            raise ApiError(413, f"the request body is larger than {limit} bytes")
    try:
        return msgspec.json.decode(bytes(data), type=type_)
    except msgspec.ValidationError as exc:
        raise ApiError(400, f"invalid request: {exc}") from None
    except msgspec.DecodeError as exc:
        raise ApiError(400, f"malformed JSON: {exc}") from None
    except RecursionError:  # msgspec's depth limit, e.g. [[[[... in a field typed Any
        raise ApiError(400, "malformed JSON: it nests too deeply") from None


def chat_generate(ctx: HttpContext, body: ChatRequest) -> tuple[requests.Generate, bool]:
    """A Chat body (or another API's request adapted to one) as the internal request, and
    whether the template was given tools (so that calls are parsed out of the reply)."""
    frontend = ctx.ready()
    convert.check_request(body, ctx.served_name(body.model))
    convert.check_prompt_chars(body, frontend.max_prompt_chars)
    tools = convert.chat_tools(body)
    ids = convert.chat_prompt_ids(body, tools, frontend.tokenizer)
    reply = convert.reply_format(body, ids, frontend.tokenizer)
    grammar = constrain.chat_grammar(body, tools, reply)
    prompt = {"input_ids": ids, "stop_token_ids": list(reply.stop_token_ids)}  # harmony's end a reply
    generate = convert.to_generate(body, prompt, convert.chat_max_tokens(body),
                                   frontend.model.max_context_tokens, grammar)
    return generate, bool(tools)


async def chat_generate_off_loop(ctx: HttpContext, body: ChatRequest) -> tuple[requests.Generate, bool]:
    """``chat_generate`` on a worker thread: rendering the template over a body of tens of MB and
    tokenizing it takes seconds, while the event loop serves every other client and the liveness
    probe."""
    return await asyncio.to_thread(chat_generate, ctx, body)


async def chat_completions(request: Request) -> Response:
    ctx = _ctx(request)
    ctx.ready()
    body = await read_body(request, ChatRequest, ctx.max_body_bytes)
    generate, _ = await chat_generate_off_loop(ctx, body)
    reply = convert.reply_format(body, generate.input_ids or (), ctx.ready().tokenizer)
    response_ids = r.ResponseIds.new("chatcmpl", body.model)
    session = await _start(ctx, generate)
    if body.stream:
        usage = body.stream_options is not None and body.stream_options.include_usage
        return sse.response(_closing(session, chat.stream(session, response_ids, reply, usage)))
    async with session:
        return json_response(await _unless_gone(request, chat.whole(session, response_ids, reply)))


async def responses(request: Request) -> Response:
    """OpenAI's Responses API, stateless: adapted to a Chat request, answered in its own shape."""
    ctx = _ctx(request)
    ctx.ready()
    body = await read_body(request, responses_api.ResponsesRequest, ctx.max_body_bytes)
    tokenizer = ctx.ready().tokenizer
    chat_body = responses_api.to_chat(body, speaks_harmony(tokenizer))
    generate, _ = await chat_generate_off_loop(ctx, chat_body)
    reply = convert.reply_format(chat_body, generate.input_ids or (), tokenizer)
    frame = responses_api.frame(body)
    session = await _start(ctx, generate)
    if body.stream:
        events = responses_reply.stream(session, frame, reply, tokenizer)
        return sse.stream(_closing(session, sse.keepalive(events)))
    async with session:
        return json_response(await _unless_gone(request, responses_reply.whole(session, frame, reply, tokenizer)))


async def text_completions(request: Request) -> Response:
    ctx = _ctx(request)
    ctx.ready()
    body = await read_body(request, CompletionRequest, ctx.max_body_bytes)
    convert.check_request(body, ctx.served_name(body.model))
    if body.echo or body.suffix or (body.best_of or 1) > 1:
        raise ApiError(400, "echo, suffix and best_of are not supported")
    grammar = constrain.response_format_grammar(body.response_format, None)
    generate = convert.to_generate(body, convert.completion_prompt(body), body.max_tokens,
                                   convert.COMPLETION_DEFAULT_MAX_TOKENS, grammar)
    response_ids = r.ResponseIds.new("cmpl", body.model)
    session = await _start(ctx, generate)
    if body.stream:
        usage = body.stream_options is not None and body.stream_options.include_usage
        return sse.response(_closing(session, completions.stream(session, response_ids, usage)))
    async with session:
        return json_response(await _unless_gone(request, completions.whole(session, response_ids)))


async def messages(request: Request) -> Response:
    """Anthropic's Messages API: adapted to a Chat request, answered (errors too) in its own shape."""
    ctx = _ctx(request)
    ctx.ready()
    body = await read_body(request, messages_api.MessagesRequest, ctx.max_body_bytes)
    chat_body = _messages_chat(ctx, body)
    generate, _ = await chat_generate_off_loop(ctx, chat_body)
    reply = convert.reply_format(chat_body, generate.input_ids or (), ctx.ready().tokenizer)
    message = messages_reply.new_message(body.model, len(generate.input_ids or ()))
    thinking = messages_api.thinking_display(body)
    session = await _start(ctx, generate)
    if body.stream:
        events = messages_reply.stream(session, message, reply, thinking)
        return sse.stream(_closing(session, sse.keepalive(events, tick=messages_reply.PING)))
    async with session:
        return json_response(await _unless_gone(request, messages_reply.whole(session, message, reply, thinking)))


async def count_tokens(request: Request) -> Response:
    """The prompt tokens a Messages request would have: its ``usage`` input counts together."""
    ctx = _ctx(request)
    ctx.ready()
    body = await read_body(request, messages_api.MessagesPrompt, ctx.max_body_bytes)
    generate, _ = await chat_generate_off_loop(ctx, _messages_chat(ctx, body))
    return json_response(messages_objects.TokenCount(input_tokens=len(generate.input_ids or ())))


def _messages_chat(ctx: HttpContext, body: messages_api.MessagesPrompt) -> ChatRequest:
    tokenizer = ctx.ready().tokenizer
    return messages_api.to_chat(body, tokenizer.chat_template, speaks_harmony(tokenizer))


async def _start(ctx: HttpContext, generate: requests.Generate) -> Session:
    session = Session(ctx.ready())
    await session.start(generate)
    return session


async def _unless_gone(request: Request, reply: Awaitable[T]) -> T:
    """``reply``, unless the client disconnects first: then the request is given up (the session's
    close aborts it) and nobody is answered."""
    answer = asyncio.ensure_future(reply)
    gone = asyncio.ensure_future(_disconnected(request))
    await asyncio.wait([answer, gone], return_when=asyncio.FIRST_COMPLETED)
    gone.cancel()
    if not answer.done():
        answer.cancel()
        raise ClientDisconnect()
    return answer.result()


async def _disconnected(request: Request) -> None:
    # The body is read: the server's next message is http.disconnect, whenever the client leaves.
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _closing(session: Session, events: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """Close the session however the stream ends: a client that disconnects cancels the stream,
    and closing aborts its request in the scheduler."""
    try:
        async for e in events:
            yield e
    finally:
        session.close()


async def models(request: Request) -> Response:
    ctx = _ctx(request)
    card = r.ModelCard(id=ctx.model_name, created=ctx.metrics.started,
                       max_model_len=ctx.ready().model.max_context_tokens)
    return json_response(r.ModelList(data=[card]))


async def health(request: Request) -> Response:
    ready = _ctx(request).frontend is not None
    return json_response({"status": "ready" if ready else "loading"}, 200 if ready else 503)


async def metrics(request: Request) -> Response:
    ctx = _ctx(request)
    stats: dict = {}
    if ctx.frontend is not None:
        async with Session(ctx.frontend) as session:
            await session.start(requests.GetStats(rid="metrics"))
            stats = await asyncio.wait_for(session.stats(), STATS_TIMEOUT_S)
    body, content_type = ctx.metrics.render(stats)
    return Response(body, media_type=content_type)
