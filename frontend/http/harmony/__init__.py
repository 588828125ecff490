"""gpt-oss's harmony chat format through the ``openai-harmony`` library: a Chat request rendered
into harmony tokens (``render``), the model's reply read back token by token as reasoning (the
analysis channel), tool calls (a message to ``functions.NAME``) and content (``reply``), and the
library's o200k vocabulary, found offline (``encoding``).

A model speaks harmony when its vocabulary holds harmony's formatting tokens at harmony's ids
(``encoding.speaks_harmony``); ``frontend.http.convert`` then renders with harmony instead of the
chat template and reads the reply with ``reply.HarmonyFormat`` instead of the text parsers.

May import: ``frontend.http.schemas``, ``frontend.http.errors``, ``frontend.http.parsers`` and
``frontend.tokenizer`` (never ``convert``, which imports this)."""
