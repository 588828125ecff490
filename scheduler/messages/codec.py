"""Typed msgpack encode/decode for tagged ``msgspec.Struct`` unions, shared by both protocols
(frontend<->scheduler here, client<->frontend in ``frontend.api``)."""

from __future__ import annotations

from typing import Any, Generic, TypeVar, get_args

import msgspec

M = TypeVar("M")


class ProtocolError(ValueError):
    """A frame that is not a valid message of the expected direction and version.

    ``rid`` is the frame's request id when it could still be read, so that the error can be
    answered on that request."""

    def __init__(self, message: str, rid: str | None = None) -> None:
        super().__init__(message)
        self.rid = rid


class Codec(Generic[M]):
    """Encoder plus typed decoder for one direction. Every message carries ``v``, the protocol
    version; a frame with another version, a malformed frame, an unknown ``type`` or a field of the
    wrong type all raise ``ProtocolError`` with a message fit to show a user."""

    def __init__(self, message_type: Any, version: int, direction: str) -> None:
        self.version = version
        self.direction = direction
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(message_type)
        self.tags = tuple(
            m.__struct_config__.tag for m in get_args(message_type) or (message_type,)
        )

    def encode(self, message: M) -> bytes:
        return self._encoder.encode(message)

    def decode(self, frame: bytes) -> M:
        try:
            message = self._decoder.decode(frame)
        except msgspec.ValidationError as exc:
            raw = _loose(frame)
            self._check_version(raw.get("v", self.version), raw)
            if "type" in raw and raw["type"] not in self.tags:
                raise ProtocolError(
                    f"unknown {self.direction} message type {raw['type']!r} "
                    f"(expected one of {', '.join(self.tags)})",
                    _rid(raw),
                ) from None
            raise ProtocolError(f"invalid {self.direction} message: {exc}", _rid(raw)) from None
        except msgspec.DecodeError as exc:
            raise ProtocolError(f"malformed {self.direction} frame (not msgpack): {exc}") from None
        except RecursionError:  # msgspec's own depth limit: a frame of nested arrays or maps
            raise ProtocolError(f"{self.direction} frame is nested too deeply") from None
        self._check_version(message.v, {"rid": getattr(message, "rid", None)})
        return message

    def _check_version(self, version: Any, raw: dict) -> None:
        if type(version) is not int:  # "1" or 1.0 would read as a version mismatch otherwise
            raise ProtocolError(
                f"{self.direction} field `v` (the protocol version) must be an integer, "
                f"got {type(version).__name__}",
                _rid(raw),
            )
        if version != self.version:
            raise ProtocolError(
                f"{self.direction} protocol version {version!r} is not supported "
                f"(this side speaks version {self.version})",
                _rid(raw),
            )


def _loose(frame: bytes) -> dict:
    # Only on the error path: the untyped view lets the error name the version and request id.
    try:
        raw = msgspec.msgpack.decode(frame)
    except (msgspec.DecodeError, RecursionError):
        return {}
    return raw if isinstance(raw, dict) else {}


def _rid(raw: dict) -> str | None:
    rid = raw.get("rid")
    return rid if isinstance(rid, str) else None
