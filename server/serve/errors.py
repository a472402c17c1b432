"""Typed errors the manager raises that the HTTP edges (`server.http.app`, `server.http.openai_api`) answer
too.

They live here, below both, so that the manager never imports an HTTP module to raise one (dependencies
point from the HTTP edge down to the manager and the engine, never back).
"""

from __future__ import annotations

from collections.abc import Sequence

from server.engine.errors import EngineError

__all__ = [
    "BatchOpError",
    "EngineRegistrationError",
    "GetTimeoutError",
    "ModelNotFoundError",
    "NoEngineError",
    "ServerDrainingError",
    "SloRejectedError",
    "UnknownEngineError",
]


class ModelNotFoundError(EngineError):
    """The request names a model no engine serves (``404 model_not_found``); raised by whatever picks an
    engine by model name: `OpenAIServing.engine_for` (`server.serve.openai_serving`) and a call's
    submission.

    An `EngineError` like `EngineFailedError`: it is about the engines in service, and every layer that
    answers engine errors with their status (the OpenAI router, a step's failure, the app's handler)
    answers it the same way."""

    http_status = 404
    error_type = "model_not_found"

    def __init__(self, model: str | None, available: Sequence[str]) -> None:
        names = ", ".join(repr(m) for m in available) or "none"
        what = "no model is being served" if model is None else f"the model {model!r} does not exist"
        super().__init__(f"{what}; available models: {names}")
        self.model = model
        self.available = list(available)


class GetTimeoutError(Exception):
    """A `get` waited its whole timeout and the variable is still pending (504)."""

    http_status = 504
    error_type = "get_timeout"


class BatchOpError(Exception):
    """Operation ``index`` of a batch failed with ``cause`` (the answer carries the cause's status)."""

    def __init__(self, index: int, op: str, cause: Exception) -> None:
        super().__init__(f"batch operation {index} ({op}) failed: {cause}")
        self.index = index
        self.cause = cause


class NoEngineError(Exception):
    """No engine is in service (for the model asked for)."""

    http_status = 503
    error_type = "no_engine"


class SloRejectedError(Exception):
    """An OpenAI request refused at admission: its engine would miss the configured TTFT or TPOT objective
    (`ManagerConfig.slo`)."""

    http_status = 503
    error_type = "slo_rejected"


class ServerDrainingError(Exception):
    """The server is shutting down gracefully: it takes no new sessions, calls or OpenAI requests."""

    http_status = 503
    error_type = "server_draining"


class EngineRegistrationError(Exception):
    """A remote engine cannot be registered: its URL is not reachable or does not serve an engine."""

    http_status = 400
    error_type = "engine_registration"


class UnknownEngineError(Exception):
    """No engine by that id, or one taken out of service (the engine registers again)."""

    http_status = 404
    error_type = "unknown_engine"
