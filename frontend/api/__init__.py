"""The client protocol: ``requests`` (client -> frontend) and ``replies`` (frontend -> client),
msgpack-encoded tagged msgspec structs (tag field ``type``, version field ``v``), one per ZMQ frame.
A client uses a DEALER socket; the frontend's ROUTER answers on the same connection."""

from frontend.api import replies, requests
from scheduler.messages.codec import ProtocolError

__all__ = ["ProtocolError", "replies", "requests"]
