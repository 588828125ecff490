"""What the HTTP handlers share: the Frontend once the scheduler is ready (None while loading),
the served model's name, the key, the body limit and the metrics."""

from __future__ import annotations

from dataclasses import dataclass, field

from frontend.http.errors import ApiError
from frontend.http.metrics import Metrics
from frontend.server import Frontend


@dataclass
class HttpContext:
    api_key: str | None
    max_body_bytes: int
    served_model_name: str | None  # None: the name the scheduler announces
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
    def model_name(self) -> str:
        return self.served_model_name or self.ready().model.name
