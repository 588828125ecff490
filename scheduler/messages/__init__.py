"""The frontend<->scheduler protocol: tagged msgspec structs, msgpack, one message per ZMQ frame.

May import: msgspec only (the frontend imports this package and nothing else of ``scheduler``).

```
 frontend (binds both, in a private temp dir)                  scheduler (connects both)
   PUSH ──ipc, --frontend-to-scheduler──▶ PULL   to_scheduler:   TokenizedRequest, AbortRequest,
                                                                 StatsRequest, Shutdown
   PULL ◀──ipc, --scheduler-to-frontend── PUSH   from_scheduler: Ready, TokenBatch, RequestError,
                                                                 StatsReply, Heartbeat
```

Flow:

1. The frontend runs ``python -m scheduler --frontend-to-scheduler EP1 --scheduler-to-frontend EP2
   <engine args>``; the engine args are the frontend's unknown CLI options, passed verbatim.
2. The scheduler loads the model and sends ``Ready(pid, model)`` once; from then on it sends a
   ``Heartbeat`` (or any message) at least every ``HEARTBEAT_INTERVAL_S``.
3. Each client request becomes a ``TokenizedRequest`` with a frontend-unique ``rid`` (and, when
   constrained, a ``Grammar``). The scheduler
   answers with ``TokenUpdate``s inside ``TokenBatch``es (one batch per step), the last one with
   ``finished=True`` and a ``finish_reason``, or with one ``RequestError``.
4. ``AbortRequest(rid)`` (client abort, stop string matched, client gone) frees the request; the
   scheduler sends nothing more for it, and the frontend ignores anything already in flight.
5. ``StatsRequest(nonce)`` -> ``StatsReply(nonce, stats)``.
6. ``Shutdown`` -> the scheduler exits 0; the frontend terminates it after a grace period.

Each message has ``v`` (the direction's ``PROTOCOL_VERSION``). ``decode`` raises ``ProtocolError``
for a malformed frame, an unknown ``type``, a wrong field type or another version.
"""

from scheduler.messages import from_scheduler, to_scheduler
from scheduler.messages.codec import Codec, ProtocolError

__all__ = ["Codec", "ProtocolError", "from_scheduler", "to_scheduler"]
