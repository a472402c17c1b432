"""`BodyLimitMiddleware`: requests whose body is over a byte limit answer 413, however the body is sent.

A ``Content-Length`` over the limit is refused before anything is read; a body without one (chunked
transfer encoding, a streamed upload) is read with a counter, and refused as soon as it passes the limit —
nothing past the limit is kept. A body within the limit is handed to the app unchanged.
"""

from __future__ import annotations

from parrot.protocol import ErrorBody, ErrorResponse
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = ["BodyLimitMiddleware"]


class BodyLimitMiddleware:
    """Pure ASGI middleware (so it sees the body messages themselves) limiting bodies to ``max_bytes``."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = _content_length(scope)
        if length is not None:
            if length > self.max_bytes:
                await self._refuse(scope, receive, send)
                return
            # The server reads exactly Content-Length bytes, so the app's own reading is bounded.
            await self.app(scope, receive, send)
            return
        messages: list[Message] = []
        size = 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break  # the client went away: the app sees that as it would have
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                await self._refuse(scope, receive, send)
                return
            if not message.get("more_body", False):
                break
        await self.app(scope, _replay(messages, receive), send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        message = f"request body over {self.max_bytes} bytes: send a smaller request"
        body = ErrorResponse(error=ErrorBody(type="body_too_large", message=message))
        response = JSONResponse(body.model_dump(exclude_none=True), status_code=413)
        response.headers["Connection"] = "close"  # the rest of the body is never read
        await response(scope, receive, send)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length" and value.isdigit():
            return int(value)
    return None


def _replay(messages: list[Message], receive: Receive) -> Receive:
    """A ``receive`` giving the buffered ``messages`` first, then the real ones (a later disconnect)."""
    pending = list(messages)

    async def replayed() -> Message:
        if pending:
            return pending.pop(0)
        return await receive()

    return replayed
