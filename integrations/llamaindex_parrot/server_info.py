"""What the server serves: the model name and its context window, from the public model cards
(``GET /v1/models``, ``GET /v1/models/{id}``: each card has the model's ``max_model_len``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import httpx
from parrot.errors import NotFoundError, ParrotError, error_from_response, error_from_transport
from parrot.openai_types import OpenAIModelCard, OpenAIModelList
from pydantic import ValidationError

__all__ = ["ServedModel", "served_model"]


@dataclass(frozen=True)
class ServedModel:
    """A model the server serves: its name and the context window (tokens) of its engines."""

    name: str
    context_window: int


def served_model(base_url: str, model: str | None, timeout: float, api_key: str | None = None) -> ServedModel:
    """The model named ``model`` (None: whatever the server runs unnamed calls on, i.e. any model it serves).

    The context window is the card's ``max_model_len``; with ``model=None``, the smallest among the served
    models, so a prompt packed for it fits whichever engine the server picks. ``api_key`` is sent when the
    server's OpenAI routes require one. Raises `parrot.ConnectionError` (naming the URL) when the server
    cannot be reached and `ValueError` when it does not serve ``model``.
    """
    if model is not None:
        try:
            card = _get(f"{base_url}/v1/models/{quote(model, safe='')}", OpenAIModelCard, timeout, api_key)
        except NotFoundError:
            served = ", ".join(repr(c.id) for c in _cards(base_url, timeout, api_key)) or "none"
            raise ValueError(
                f"the Parrot server at {base_url} does not serve model {model!r}; it serves {served}"
            ) from None
        return ServedModel(model, _window(card, base_url))
    cards = _cards(base_url, timeout, api_key)
    if not cards:
        raise ValueError(f"the Parrot server at {base_url} has no live engine; start one first")
    name = "|".join(sorted(c.id for c in cards))  # one model: its name
    return ServedModel(name, min(_window(c, base_url) for c in cards))


def _cards(base_url: str, timeout: float, api_key: str | None) -> list[OpenAIModelCard]:
    return _get(f"{base_url}/v1/models", OpenAIModelList, timeout, api_key).data


def _window(card: OpenAIModelCard, base_url: str) -> int:
    if card.max_model_len is None:
        raise ParrotError(f"the server at {base_url} does not publish the context window of {card.id!r}")
    return card.max_model_len


def _get(url: str, model: type[Any], timeout: float, api_key: str | None) -> Any:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    try:
        response = httpx.get(url, timeout=timeout, headers=headers)
    except httpx.TransportError as e:
        raise error_from_transport(e, url) from e
    if not response.is_success:
        raise error_from_response(response)
    try:
        return model.model_validate(response.json())
    except (ValidationError, ValueError) as e:
        raise ParrotError(f"GET {url} answered what this client cannot read: {e}") from None
