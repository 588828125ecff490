"""The model's tokenizer (tokenizer.json through ``tokenizers``) and its chat template
(tokenizer_config.json, rendered with jinja2 the way transformers does)."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any, Mapping, Sequence

import jinja2
import jinja2.sandbox
import tokenizers

from frontend.kept_ids import KeptIds
from frontend.prompt_pieces import PromptPieces


# The variables render_chat sets itself; a request's template kwargs may set any other.
RENDER_VARIABLES = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"})


class ChatTemplateError(ValueError):
    """The template refused the conversation (``raise_exception``) or failed to render."""


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _token_text(value: Any) -> str | None:
    # tokenizer_config.json spells special tokens as a string or as {"content": ...}.
    if isinstance(value, dict):
        return value.get("content")
    return value


def _read_chat_template(path: Path, config: dict) -> str | None:
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: take "default"
        named = {t["name"]: t["template"] for t in template}
        template = named.get("default") or next(iter(named.values()), None)
    if template is None and (path / "chat_template.jinja").is_file():
        template = (path / "chat_template.jinja").read_text()
    if template is None and (path / "chat_template.json").is_file():
        template = json.loads((path / "chat_template.json").read_text()).get("chat_template")
    return template


class ChatTokenizer:
    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        chat_template: str | None = None,
        bos_token: str | None = None,
        eos_token: str | None = None,
    ) -> None:
        # a tokenizer.json may set truncation or padding: a prompt is never cut (one too long is
        # refused against the context) nor padded (prompt_pieces encodes pieces in batches)
        tokenizer.no_truncation()
        tokenizer.no_padding()
        self.tokenizer = tokenizer
        # a conversation's earlier messages are not tokenized again: the chat template's prompt
        # pieces and harmony's rendered messages keep their ids, in two LRUs (a gpt-oss server takes
        # both ways, ZMQ chats through its template and HTTP through openai-harmony, and a text sent
        # one way must never be taken for the other way's key)
        self.pieces = PromptPieces(tokenizer)
        self.harmony_messages = KeptIds()
        self.chat_template = chat_template  # the Jinja source
        self.bos_token = bos_token
        self.eos_token = eos_token
        self._template = None
        if chat_template is not None:
            env = jinja2.sandbox.ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
            )
            env.filters["tojson"] = lambda x, indent=None: json.dumps(
                x, ensure_ascii=False, indent=indent
            )
            env.globals["raise_exception"] = _raise_exception
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            self._template = env.from_string(chat_template)

    @classmethod
    def from_dir(cls, path: str | Path) -> ChatTokenizer:
        path = Path(path)
        tokenizer = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
        config_file = path / "tokenizer_config.json"
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        return cls(
            tokenizer,
            _read_chat_template(path, config),
            _token_text(config.get("bos_token")),
            _token_text(config.get("eos_token")),
        )

    def encode(self, text: str) -> list[int]:
        """A raw prompt, plus the special tokens (BOS) that tokenizer.json's post-processor adds."""
        # encode_batch releases the GIL (encode does not): a long prompt tokenized on a worker
        # thread then leaves the frontend's event loop running
        return self.tokenizer.encode_batch([text], add_special_tokens=True)[0].ids

    @property
    def kept(self) -> tuple[KeptIds, KeptIds]:
        """Both LRUs of kept ids (the stats add them up)."""
        return self.pieces.kept, self.harmony_messages

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """``tools`` (OpenAI tool definitions) reach the template as transformers passes them;
        ``template_kwargs`` are further variables (e.g. ``enable_thinking``), as transformers'
        ``apply_chat_template(**kwargs)`` passes them."""
        if self._template is None:
            raise ChatTemplateError("the model has no chat template; send a prompt instead")
        try:
            return self._template.render({
                **(template_kwargs or {}),  # never over the variables set here (RENDER_VARIABLES)
                "messages": list(messages),
                "tools": list(tools) if tools else None,
                "add_generation_prompt": True,
                "bos_token": self.bos_token or "",
                "eos_token": self.eos_token or "",
            })
        except ChatTemplateError:
            raise
        except (jinja2.TemplateError, TypeError, ValueError) as exc:  # the request's values, misused
            raise ChatTemplateError(f"chat template failed: {exc}") from exc

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        # The template writes BOS itself when the model wants one, as transformers assumes.
        return self.pieces.encode(self.render_chat(messages, tools, template_kwargs))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)
