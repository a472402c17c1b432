"""What the server serves: the model name and its context window, from ``GET /v1/engines``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import httpx
from parrot.errors import ParrotError, error_from_response, error_from_transport
from parrot.protocol import EngineStats
from pydantic import ValidationError

__all__ = ["ServedModel", "served_model"]


@dataclass(frozen=True)
class ServedModel:
    """A model the server serves: its name and the context window (tokens) of its engines."""

    name: str
    context_window: int


def served_model(base_url: str, model: str | None, timeout: float) -> ServedModel:
    """The model named ``model`` (None: whatever the server runs unnamed calls on, i.e. any engine).

    The context window is the smallest ``max_model_len`` among the engines that may serve a call, so a
    prompt packed for it fits whichever engine the server picks. Raises `parrot.ConnectionError` (naming
    the URL) when the server cannot be reached and `ValueError` when it does not serve ``model``.
    """
    url = f"{base_url}/v1/engines"
    try:
        response = httpx.get(url, timeout=timeout)
    except httpx.TransportError as e:
        raise error_from_transport(e, url) from e
    if not response.is_success:
        raise error_from_response(response)
    engines = _live_engines(response.json(), url)
    if not engines:
        raise ValueError(f"the Parrot server at {base_url} has no live engine; start one first")
    if model is None:  # the server may route an unnamed model's calls to any engine
        names = sorted({e.model for e in engines})
        name = names[0] if len(names) == 1 else "|".join(names)
        return ServedModel(name, min(e.max_model_len for e in engines))
    serving = [e for e in engines if e.model == model]
    if not serving:
        served = ", ".join(sorted({repr(e.model) for e in engines}))
        raise ValueError(
            f"the Parrot server at {base_url} does not serve model {model!r}; it serves {served}"
        )
    return ServedModel(model, min(e.max_model_len for e in serving))


def _live_engines(data: Any, url: str) -> list[EngineStats]:
    """The stats of the engines that serve: each item of the list is an engine's status (its ``stats`` and
    whether it is ``alive``) or, from servers before engine registration, the stats themselves."""
    if not isinstance(data, list):
        raise ParrotError(f"GET {url} answered {type(data).__name__}, not a list of engines")
    engines = []
    try:
        for item in data:
            if isinstance(item, dict) and "stats" in item:
                if item.get("alive", True):
                    engines.append(EngineStats.model_validate(item["stats"]))
            else:
                engines.append(EngineStats.model_validate(item))
    except ValidationError as e:
        raise ParrotError(f"GET {url} answered engines this client cannot read: {e}") from None
    return engines
