"""HTTP to a Parrot server: one reused httpx client, timeouts, retries with backoff, typed errors.

`ServerConnection` is what `ParrotLLM` and `ChatParrot` talk through. It makes nothing at construction;
the sync client is created on first use and reused, async clients are made one per event loop (an
``httpx.AsyncClient`` must not outlive the loop it first ran on). Failures become the `parrot` client's
typed errors — `parrot.ConnectionError` for a server that is down or too slow, naming the URL — after
``max_retries`` retries of what is worth retrying (transport errors, 429, 502, 503, 504) with exponential
backoff. Streams are server-sent events (``data: {...}``); a stream is retried only before its first event.
"""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
import weakref
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any, TypeVar

import httpx
from parrot.errors import (
    ConnectionError as ParrotConnectionError,
    ParrotError,
    error_from_response,
    error_from_transport,
)
from parrot.protocol import ErrorResponse
from parrot.urls import server_root

__all__ = ["RETRY_STATUSES", "ServerConnection", "backoff_delay", "with_attempts"]

# Statuses that say "try again later" rather than "your request is wrong".
RETRY_STATUSES = frozenset({429, 502, 503, 504})
_BACKOFF_BASE_S = 0.25
_BACKOFF_CAP_S = 4.0

T = TypeVar("T")


def backoff_delay(attempt: int, rng: random.Random | None = None) -> float:
    """Seconds to wait before retry number ``attempt`` (0-based): doubling from 0.25 s, capped at 4 s,
    with up to 10% jitter so that many clients do not retry in lockstep."""
    delay = min(_BACKOFF_CAP_S, _BACKOFF_BASE_S * 2**attempt)
    return delay * (1 + 0.1 * (rng or random).random())


def with_attempts(error: ParrotError, url: str, attempts: int) -> ParrotError:
    """``error`` with the request's URL and the number of attempts made added to its message."""
    if attempts <= 1 and url in error.message:
        return error
    where = "" if url in error.message else f" ({url})"
    tries = f"; gave up after {attempts} attempts" if attempts > 1 else ""
    new = type(error)(f"{error.message}{where}{tries}", status=error.status, type=error.type)
    new.__cause__ = error.__cause__
    return new


def _retryable(error: ParrotError) -> bool:
    return isinstance(error, ParrotConnectionError) or error.status in RETRY_STATUSES


class ServerConnection:
    """Requests to one Parrot server (``base_url``, its root or its ``/v1``), sync or async, retried
    ``max_retries`` times.

    ``timeout`` (seconds, None for none) bounds each attempt's connect, each read and each write; a
    non-streaming generation must finish within it. ``headers`` go with every request. ``client`` /
    ``async_client`` are clients you own (not closed here), for proxies, custom transports or tests.
    """

    def __init__(
        self,
        base_url: str,
        *,
        timeout: float | None,
        max_retries: int,
        headers: dict[str, str] | None = None,
        client: httpx.Client | None = None,
        async_client: httpx.AsyncClient | None = None,
    ) -> None:
        if max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {max_retries}")
        self.base_url = server_root(base_url, what="base_url")
        self.timeout = timeout
        self.max_retries = max_retries
        self.headers = dict(headers or {})
        self._given_client = client
        self._given_async_client = async_client
        self._client: httpx.Client | None = client
        self._async_clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, httpx.AsyncClient] = (
            weakref.WeakKeyDictionary()
        )
        self._lock = threading.Lock()

    # ----------------------------------------------------------------------------------------- clients
    @property
    def client(self) -> httpx.Client:
        """The sync client (created on first use, then reused)."""
        if self._client is None:
            with self._lock:
                if self._client is None:
                    self._client = httpx.Client(timeout=self.timeout, headers=self.headers)
        return self._client

    @property
    def async_client(self) -> httpx.AsyncClient:
        """The async client of the running event loop (created on first use in that loop)."""
        if self._given_async_client is not None:
            return self._given_async_client
        loop = asyncio.get_running_loop()
        client = self._async_clients.get(loop)
        if client is None:
            client = httpx.AsyncClient(timeout=self.timeout, headers=self.headers)
            self._async_clients[loop] = client
        return client

    def close(self) -> None:
        """Close the sync client this connection made (a given client is left to its owner)."""
        if self._given_client is None and self._client is not None:
            self._client.close()
            self._client = None

    def url(self, path: str) -> str:
        return self.base_url + path

    # ---------------------------------------------------------------------------------------- retrying
    def retrying(self, url: str, attempt: Callable[[], T]) -> T:
        """Run ``attempt`` (which raises `ParrotError`) until it succeeds or retries run out."""
        for n in range(self.max_retries + 1):
            try:
                return attempt()
            except ParrotError as e:
                if n == self.max_retries or not _retryable(e):
                    raise with_attempts(e, url, n + 1) from e.__cause__
            time.sleep(backoff_delay(n))
        raise AssertionError("unreachable")

    async def aretrying(self, url: str, attempt: Callable[[], Any]) -> Any:
        """``await`` form of `retrying`: ``attempt`` returns an awaitable."""
        for n in range(self.max_retries + 1):
            try:
                return await attempt()
            except ParrotError as e:
                if n == self.max_retries or not _retryable(e):
                    raise with_attempts(e, url, n + 1) from e.__cause__
            await asyncio.sleep(backoff_delay(n))
        raise AssertionError("unreachable")

    # ------------------------------------------------------------------------------------------ JSON
    def get(self, path: str) -> Any:
        """GET ``path`` and return the JSON answer."""
        url = self.url(path)

        def attempt() -> Any:
            try:
                response = self.client.get(url)
            except httpx.TransportError as e:
                raise error_from_transport(e, url) from e
            return _json(response)

        return self.retrying(url, attempt)

    def post(self, path: str, body: dict[str, Any]) -> Any:
        """POST ``body`` as JSON and return the JSON answer."""
        url = self.url(path)

        def attempt() -> Any:
            try:
                response = self.client.post(url, json=body)
            except httpx.TransportError as e:
                raise error_from_transport(e, url) from e
            return _json(response)

        return self.retrying(url, attempt)

    async def apost(self, path: str, body: dict[str, Any]) -> Any:
        """``await`` form of `post`."""
        url = self.url(path)

        async def attempt() -> Any:
            try:
                response = await self.async_client.post(url, json=body)
            except httpx.TransportError as e:
                raise error_from_transport(e, url) from e
            return _json(response)

        return await self.aretrying(url, attempt)

    # --------------------------------------------------------------------------------------- streams
    def stream(self, path: str, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """POST ``body`` and yield each server-sent event's JSON until ``[DONE]``."""
        url = self.url(path)

        def attempt() -> tuple[dict[str, Any] | None, Iterator[dict[str, Any]]]:
            gen = self._stream_events(url, body)
            try:
                return next(gen), gen
            except StopIteration:
                return None, gen

        first, events = self.retrying(url, attempt)
        if first is None:
            return
        yield first
        yield from events

    def _stream_events(self, url: str, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
        try:
            with self.client.stream("POST", url, json=body) as response:
                if not response.is_success:
                    response.read()
                    raise error_from_response(response)
                for line in response.iter_lines():
                    event = _event(line, url)
                    if event is _DONE:
                        return
                    if event is not None:
                        yield event
        except httpx.TransportError as e:
            raise error_from_transport(e, url) from e

    async def astream(self, path: str, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """``async for`` form of `stream`."""
        url = self.url(path)

        async def attempt() -> tuple[dict[str, Any] | None, AsyncIterator[dict[str, Any]]]:
            gen = self._astream_events(url, body)
            try:
                return await anext(gen), gen
            except StopAsyncIteration:
                return None, gen

        first, events = await self.aretrying(url, attempt)
        if first is None:
            return
        yield first
        async for event in events:
            yield event

    async def _astream_events(self, url: str, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        try:
            async with self.async_client.stream("POST", url, json=body) as response:
                if not response.is_success:
                    await response.aread()
                    raise error_from_response(response)
                async for line in response.aiter_lines():
                    event = _event(line, url)
                    if event is _DONE:
                        return
                    if event is not None:
                        yield event
        except httpx.TransportError as e:
            raise error_from_transport(e, url) from e


_DONE: dict[str, Any] = {}  # sentinel for "data: [DONE]" (compared by identity)


def _event(line: str, url: str) -> dict[str, Any] | None:
    """One SSE line: its JSON, `_DONE`, or None (blank lines, comments, other fields)."""
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    if data == "[DONE]":
        return _DONE
    try:
        event = json.loads(data)
    except ValueError:
        raise ParrotError(
            f"the server at {url} sent a stream event that is not JSON: {data[:200]!r}"
        ) from None
    if isinstance(event, dict) and "error" in event and "choices" not in event:
        # An error after the stream began (the status was already 200): the server's error body.
        try:
            err = ErrorResponse.model_validate(event).error
        except ValueError:
            raise ParrotError(f"the stream from {url} failed: {event['error']}") from None
        raise ParrotError(f"the stream from {url} failed: {err.message}", type=err.type)
    return event


def _json(response: httpx.Response) -> Any:
    if not response.is_success:
        raise error_from_response(response)
    try:
        return response.json()
    except ValueError:
        raise ParrotError(
            f"the server answered {response.request.url} with non-JSON text: {response.text[:200]!r}"
        ) from None
