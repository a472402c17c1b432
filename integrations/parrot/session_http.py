"""The HTTP side of a `parrot.Session`: one httpx client (sync or async), the server's URL, the credentials
sent with every request (the session's token, an API key) and connection retries; answers come back as JSON
or as lines, errors as `parrot.errors` types."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx

from parrot.errors import (
    ConnectionError as ParrotConnectionError,
    ParrotError,
    error_from_response,
    error_from_transport,
)
from parrot.protocol import API_KEY_HEADER

__all__ = ["SessionHTTP"]

# The first wait before trying again to connect (`Session.connect_retries`); it doubles each time.
_CONNECT_BACKOFF_S = 0.25


class SessionHTTP:
    """Requests of one session to the server at ``url`` over ``client``: each bounded by ``timeout`` (plus
    a long poll's own wait), a stream's connection tried ``connect_retries`` more times with backoff."""

    def __init__(
        self,
        url: str,
        client: httpx.Client | httpx.AsyncClient,
        timeout: float,
        connect_retries: int,
        api_key: str | None,
    ) -> None:
        self.url = url
        self.client = client
        self.timeout = timeout
        self.connect_retries = connect_retries
        self.api_key = api_key
        self.token: str | None = None  # the session's secret, once chosen

    def _args(
        self, body: dict[str, Any] | None, params: dict[str, Any] | None, wait: float, auth: bool
    ) -> dict[str, Any]:
        headers = {"Authorization": f"Bearer {self.token}"} if auth else {}
        if self.api_key is not None:
            headers[API_KEY_HEADER] = self.api_key
        # A long poll may legitimately take `wait` seconds before the answer starts.
        return {"json": body, "params": params, "headers": headers, "timeout": self.timeout + wait}

    def request(
        self,
        method: str,
        path: str,
        body: dict[str, Any] | None,
        *,
        params: dict[str, Any] | None = None,
        wait: float = 0.0,
        auth: bool = True,
    ) -> Any:
        assert isinstance(self.client, httpx.Client)
        url = self.url + path
        try:
            response = self.client.request(method, url, **self._args(body, params, wait, auth))
        except httpx.TransportError as e:
            raise error_from_transport(e, url) from e
        return _answer(response)

    @contextlib.contextmanager
    def stream(
        self, path: str, body: dict[str, Any] | None, params: dict[str, Any] | None = None, wait: float = 0.0
    ) -> Iterator[Iterator[str]]:
        """POST ``body`` (GET without one) and yield the answer's lines as they arrive (a typed error for a
        non-2xx); a batch's own get bounds the wait."""
        assert isinstance(self.client, httpx.Client)
        url = self.url + path
        method = "GET" if body is None else "POST"
        wait = max(wait, (body or {}).get("get", {}).get("timeout", 0.0))
        args = self._args(body, params, wait, True)
        try:
            for attempt in range(self.connect_retries + 1):
                opened = self.client.stream(method, url, **args)
                try:
                    response = opened.__enter__()
                    break
                except (httpx.ConnectError, httpx.ConnectTimeout) as e:
                    if attempt == self.connect_retries:
                        raise _gave_up(e, url, attempt + 1) from e
                    time.sleep(_CONNECT_BACKOFF_S * 2**attempt)
            try:
                if not response.is_success:
                    response.read()
                    raise error_from_response(response)
                yield (line for line in response.iter_lines() if line)
            finally:
                opened.__exit__(None, None, None)
        except httpx.TransportError as e:
            raise error_from_transport(e, url) from e

    @contextlib.asynccontextmanager
    async def astream(
        self, path: str, body: dict[str, Any] | None, params: dict[str, Any] | None = None, wait: float = 0.0
    ) -> AsyncIterator[AsyncIterator[str]]:
        """``async`` form of `stream`."""
        assert isinstance(self.client, httpx.AsyncClient)
        url = self.url + path
        method = "GET" if body is None else "POST"
        wait = max(wait, (body or {}).get("get", {}).get("timeout", 0.0))
        args = self._args(body, params, wait, True)
        try:
            for attempt in range(self.connect_retries + 1):
                opened = self.client.stream(method, url, **args)
                try:
                    response = await opened.__aenter__()
                    break
                except (httpx.ConnectError, httpx.ConnectTimeout) as e:
                    if attempt == self.connect_retries:
                        raise _gave_up(e, url, attempt + 1) from e
                    await asyncio.sleep(_CONNECT_BACKOFF_S * 2**attempt)
            try:
                if not response.is_success:
                    await response.aread()
                    raise error_from_response(response)
                yield (line async for line in response.aiter_lines() if line)
            finally:
                await opened.__aexit__(None, None, None)
        except httpx.TransportError as e:
            raise error_from_transport(e, url) from e

    async def arequest(
        self,
        method: str,
        path: str,
        body: dict[str, Any] | None,
        *,
        params: dict[str, Any] | None = None,
        wait: float = 0.0,
        auth: bool = True,
    ) -> Any:
        assert isinstance(self.client, httpx.AsyncClient)
        url = self.url + path
        try:
            response = await self.client.request(method, url, **self._args(body, params, wait, auth))
        except httpx.TransportError as e:
            raise error_from_transport(e, url) from e
        return _answer(response)


def _gave_up(error: httpx.TransportError, url: str, attempts: int) -> ParrotConnectionError:
    """The connection error of the last of ``attempts`` tries to reach ``url``."""
    failed = error_from_transport(error, url)
    if attempts == 1:
        return failed
    return ParrotConnectionError(f"{failed.message}; gave up after {attempts} attempts")


def _answer(response: httpx.Response) -> Any:
    if not response.is_success:
        raise error_from_response(response)
    if not response.content:
        return None
    try:
        return response.json()
    except ValueError as e:
        raise ParrotError(f"the server answered {response.request.url} with non-JSON text: {e}") from None
