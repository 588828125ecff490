"""What the HTTP handlers share: the Frontend once the scheduler is ready (None while loading),
the served model's names, the key, the body limit and the metrics."""

from __future__ import annotations

from dataclasses import dataclass, field

from frontend.http.errors import ApiError
from frontend.http.metrics import Metrics
from frontend.server import Frontend


@dataclass
class HttpContext:
    api_key: str | None
    max_body_bytes: int
    served_model_names: tuple[str, ...]  # (): the name the scheduler announces
    metrics: Metrics = field(default_factory=Metrics)
    frontend: Frontend | None = None  # set once the scheduler is ready, cleared when stopping
    stopping: bool = False

    def ready(self) -> Frontend:
        if self.stopping:
            raise ApiError(503, "the server is shutting down")
        if self.frontend is None:
            raise ApiError(503, "the model is still loading; retry when /health answers 200")
        return self.frontend

    @property
    def model_names(self) -> tuple[str, ...]:
        """Every name a request may give, aliases for clients that send their own (e.g.
        claude-sonnet-4-5); the first is the one /v1/models lists."""
        return self.served_model_names or (self.ready().model.name,)

    @property
    def model_name(self) -> str:
        return self.model_names[0]

    def served_name(self, requested: str) -> str:
        """``requested`` when it is one of the model's names, else the primary name (that a
        check of the request's model then refuses, naming it)."""
        return requested if requested in self.model_names else self.model_name
