"""Which routing the model runs (``--routing``) and whether to record it (``--record-routing``):
options only, without torch, so that the command line's ``--help`` does not import it."""
from __future__ import annotations

from dataclasses import dataclass

ROUTINGS = ("model", "synthetic", "replay:FILE")


@dataclass(frozen=True)
class RoutingOptions:
    routing: str = "model"  # "model" | "synthetic" (needs dummy weights) | "replay:FILE"
    record: str | None = None  # trace file written at exit
    record_tokens: int = 65536  # tokens the record holds (device buffers sized up front)
    seed: int = 0  # of the synthetic router

    def check(self, dummy_weights: bool) -> None:
        if self.routing not in ("model", "synthetic") and not self.routing.startswith("replay:"):
            raise ValueError(f"--routing {self.routing!r} is not one of {', '.join(ROUTINGS)}")
        if self.routing == "synthetic" and not dummy_weights:
            raise ValueError("--routing synthetic replaces the router of seeded random weights: "
                             "it needs --dummy-weights")
