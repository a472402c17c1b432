"""Typed errors the manager raises that the HTTP edges (`server.app`, `server.openai_api`) answer too.

They live here, below both, so that the manager never imports an HTTP module to raise one (dependencies
point from the HTTP edge down to the manager and the engine, never back).
"""

from __future__ import annotations

from collections.abc import Sequence

from server.engine.errors import EngineError

__all__ = ["ModelNotFoundError"]


class ModelNotFoundError(EngineError):
    """The request names a model no engine serves (``404 model_not_found``); raised by whatever picks an
    engine by model name: `OpenAIBackend.engine_for` (the manager, `server.openai_api.StaticBackend`) and
    a call's submission.

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
