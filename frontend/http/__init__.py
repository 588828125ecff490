"""The OpenAI-compatible HTTP API of the frontend process: ``/v1/chat/completions``,
``/v1/completions``, ``/v1/models``, ``/health`` and ``/metrics`` (Starlette on uvicorn, msgspec
for JSON), beside the ZMQ socket and over the same ``frontend.server.Frontend``.

May import: the rest of ``frontend`` and ``scheduler.messages`` (as all of ``frontend``)."""
