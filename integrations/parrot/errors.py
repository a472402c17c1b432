"""Typed exceptions of the Parrot client.

The server answers every error as ``{"error": {"type", "message"}}`` with a status code; `error_from_response`
turns that into the `ParrotError` subclass for the status, keeping the server's ``type`` and ``message``.
Transport failures (refused connection, timeout) become `ConnectionError`, with the URL in the message.
"""

from __future__ import annotations

import builtins
import json

import httpx

from parrot.protocol import ErrorResponse

__all__ = [
    "AuthError",
    "BadRequestError",
    "ConflictError",
    "ConnectionError",
    "GetTimeoutError",
    "NotFoundError",
    "ParrotError",
    "PayloadTooLargeError",
    "ServiceUnavailableError",
    "UnprocessableEntityError",
    "VariableFailedError",
    "error_from_response",
    "error_from_transport",
]


class ParrotError(Exception):
    """Base of every error the client raises about the service.

    ``status`` is the HTTP status code (None when the client itself detected the problem), ``type`` the
    server's error type (e.g. ``"bad_template"``), ``message`` its human-readable explanation and
    ``op_index`` the failing operation of a batch.
    """

    default_type = "error"

    def __init__(
        self, message: str, *, status: int | None = None, type: str | None = None, op_index: int | None = None
    ) -> None:
        self.message = message
        self.status = status
        self.type = type or self.default_type
        self.op_index = op_index  # which operation of a batch failed (see `parrot.protocol.BatchRequest`)
        prefix = f"{status} " if status is not None else ""
        super().__init__(f"{prefix}{self.type}: {message}")


class BadRequestError(ParrotError):
    """400: the request is wrong (a malformed template, an unknown criteria, a cycle...)."""

    default_type = "bad_request"


class AuthError(ParrotError):
    """401/403: a missing or wrong session token, or a token of another session."""

    default_type = "auth"


class NotFoundError(ParrotError):
    """404: an unknown (or expired, or deleted) session or variable."""

    default_type = "not_found"


class ConflictError(ParrotError):
    """409: a conflict, such as a variable set twice."""

    default_type = "conflict"


class PayloadTooLargeError(ParrotError):
    """413: the request body is over the server's limit."""

    default_type = "payload_too_large"


class UnprocessableEntityError(ParrotError):
    """422: the body does not match the wire schema."""

    default_type = "unprocessable_entity"


class ServiceUnavailableError(ParrotError):
    """503: no engine can serve the request."""

    default_type = "service_unavailable"


class GetTimeoutError(ParrotError):
    """504: a variable is still pending after the ``timeout`` given to ``get``."""

    default_type = "get_timeout"


class VariableFailedError(ParrotError):
    """The variable failed on the server (its producer, a transform, or an upstream variable failed).

    ``message`` names the variable and gives the server's explanation, ``reason`` is that explanation
    alone (the variable's ``error`` as the server sent it); ``var_id`` the failed variable. ``error_type``
    is the server's type of the root cause (``"transform_failed"``, ``"engine_failed"``...; the same for a
    variable that failed because an input did) and ``llm_output`` the model's whole text when a transform
    refused to parse it, here or upstream (see `parrot.protocol.GetVariableResponse`); both None when the
    server did not send them.
    """

    default_type = "variable_failed"

    def __init__(
        self,
        message: str,
        *,
        var_id: str | None = None,
        reason: str | None = None,
        error_type: str | None = None,
        llm_output: str | None = None,
    ) -> None:
        self.var_id = var_id
        self.reason = reason
        self.error_type = error_type
        self.llm_output = llm_output
        super().__init__(message)


class ConnectionError(ParrotError, builtins.ConnectionError):
    """The server could not be reached (refused, reset, timed out); the message names the URL.

    Also the builtin `ConnectionError` (an `OSError`), so code written for any network client — an
    ``except ConnectionError`` or a retry policy on it — handles it without knowing Parrot.
    """

    default_type = "connection"


_BY_STATUS: dict[int, type[ParrotError]] = {
    400: BadRequestError,
    401: AuthError,
    403: AuthError,
    404: NotFoundError,
    409: ConflictError,
    413: PayloadTooLargeError,
    422: UnprocessableEntityError,
    503: ServiceUnavailableError,
    504: GetTimeoutError,
}


def error_from_response(response: httpx.Response) -> ParrotError:
    """The typed error for a non-2xx response (tolerant of bodies not in the error schema)."""
    status = response.status_code
    cls = _BY_STATUS.get(status, ParrotError)
    try:
        body = ErrorResponse.model_validate_json(response.content)
        return cls(body.error.message, status=status, type=body.error.type, op_index=body.error.op_index)
    except ValueError:
        pass
    try:  # FastAPI's default `{"detail": ...}` or anything else JSON
        data = json.loads(response.content)
        detail = data.get("detail", data) if isinstance(data, dict) else data
        message = detail if isinstance(detail, str) else json.dumps(detail)
    except ValueError:
        message = response.text or response.reason_phrase
    return cls(f"{response.request.method} {response.request.url}: {message}", status=status)


def error_from_transport(exc: httpx.TransportError, url: str) -> ConnectionError:
    """A `ConnectionError` for an httpx transport failure on ``url``."""
    what = "timed out" if isinstance(exc, httpx.TimeoutException) else "failed"
    detail = str(exc) or type(exc).__name__
    return ConnectionError(f"request to the Parrot server at {url} {what}: {detail}")
