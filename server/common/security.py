"""Secure by default: the cluster token, the OpenAI API keys, and the FastAPI guards that check them.

The **cluster token** is the shared secret of one manager and its engines: engines register, heartbeat and
unregister with it, the manager sends it on every call to an engine's HTTP API, and ``GET /v1/engines``
answers only its holder. It comes from ``--cluster-token-file PATH``, else ``$PARROT_CLUSTER_TOKEN``, else
the default file (``$PARROT_CACHE_DIR`` or ``~/.cache/parrot-serve``, ``cluster_token``); a file that does not
exist yet is created with a fresh token, readable only by its owner (0600) — so a manager and engines
started by one user on one machine agree with no setup, and another machine gets the file (or the variable).

**API keys** (``--api-key``, ``$PARROT_API_KEY``), when set, guard every route that generates: the
OpenAI-compatible routes and the opening of a session (whose own token then guards its routes).

Every comparison is constant-time (`hmac.compare_digest`); a secret is never logged or echoed.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from parrot.protocol import API_KEY_ENV, API_KEY_HEADER, ErrorBody, ErrorResponse

from server.common.auth_first import header_guard
from server.common.settings import API_KEY, CLUSTER_TOKEN, cache_dir

__all__ = [
    "API_KEY_ENV",
    "API_KEY_HEADER",
    "CLUSTER_TOKEN_ENV",
    "AuthError",
    "ClusterToken",
    "SecurityConfig",
    "api_key_guard",
    "api_keys_from",
    "bearer_token",
    "check_api_key",
    "check_secret",
    "cluster_token_guard",
    "default_token_path",
    "install_auth_handler",
    "load_cluster_token",
    "matches_any",
    "presented_api_key",
    "tenant_of",
]

log = logging.getLogger(__name__)

CLUSTER_TOKEN_ENV = CLUSTER_TOKEN.name
TOKEN_FILE_NAME = "cluster_token"
# What a caller is told to use, named in every refusal (the setting, never the secret).
CLUSTER_TOKEN_HINT = (
    f"send 'Authorization: Bearer <cluster token>': the manager's token is in ${CLUSTER_TOKEN_ENV} or the "
    "file given with --cluster-token-file (by default the file the manager logged at start)"
)
API_KEY_HINT = (
    f"send 'Authorization: Bearer <API key>' (or '{API_KEY_HEADER}: <API key>', which a session's requests "
    f"use beside their session token) with one of the keys the server was started with "
    f"(--api-key or ${API_KEY_ENV})"
)


class AuthError(Exception):
    """A request without the credential a route needs (401) or with a wrong one (403)."""

    def __init__(self, message: str, http_status: int, error_type: str) -> None:
        super().__init__(message)
        self.http_status = http_status
        self.error_type = error_type


@dataclass(frozen=True)
class ClusterToken:
    """A cluster token and where it came from (``source``: a file path, the variable, or "generated")."""

    value: str = field(repr=False)
    source: str


@dataclass(frozen=True)
class SecurityConfig:
    """What the manager's app checks: the cluster token, the OpenAI API keys (empty: the OpenAI routes are
    open) and how many remote engines may be registered and in service at once."""

    cluster_token: str = field(repr=False)
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    max_remote_engines: int = 64

    def __post_init__(self) -> None:
        if not self.cluster_token:
            raise ValueError("the cluster token must not be empty")
        if any(not key for key in self.api_keys):
            raise ValueError("an API key must not be empty")
        if self.max_remote_engines < 0:
            raise ValueError(f"max_remote_engines must be >= 0, got {self.max_remote_engines}")

    @classmethod
    def generated(cls, api_keys: tuple[str, ...] = (), max_remote_engines: int = 64) -> SecurityConfig:
        """A config with a fresh random cluster token (known only to whoever holds this object)."""
        return cls(secrets.token_urlsafe(32), api_keys, max_remote_engines)


# ------------------------------------------------------------------------------------------- the token
def default_token_path() -> Path:
    """``$PARROT_CACHE_DIR/cluster_token``, else ``~/.cache/parrot-serve/cluster_token``."""
    return cache_dir() / TOKEN_FILE_NAME


def load_cluster_token(token_file: str | Path | None = None) -> ClusterToken:
    """The cluster token: from ``token_file`` when given, else ``$PARROT_CLUSTER_TOKEN``, else the default
    file. A file that does not exist is created with a new token (mode 0600, its folder 0700) and the path
    is logged; an empty or unreadable file raises `ValueError` naming it."""
    if token_file is None:
        env = CLUSTER_TOKEN.get()
        if env:
            return ClusterToken(env, f"${CLUSTER_TOKEN_ENV}")
    path = Path(token_file).expanduser() if token_file is not None else default_token_path()
    token = _read_token_file(path)
    if token is None:
        token = _create_token_file(path)
    return ClusterToken(token, str(path))


def _read_token_file(path: Path) -> str | None:
    """The token in ``path`` (None when there is no such file)."""
    try:
        text = path.read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise ValueError(f"cannot read the cluster token file {path}: {e.strerror}") from None
    if not text:
        raise ValueError(
            f"the cluster token file {path} is empty: delete it (a new token is made) or fill it"
        )
    if path.stat().st_mode & 0o077:
        log.warning("the cluster token file %s is readable by other users: chmod 600 it", path)
    return text


def _create_token_file(path: Path) -> str:
    """Write a new token to ``path``, readable only by its owner; if another process created the file
    first, its token wins (both then agree)."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    token = secrets.token_urlsafe(32)
    try:
        # O_EXCL: never overwrite a token someone already uses; 0o600 from the start, no readable window.
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        existing = _read_token_file(path)
        if existing is None:  # deleted again in between: give up rather than loop
            raise ValueError(f"the cluster token file {path} vanished while being created") from None
        return existing
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(token + "\n")
    log.warning(
        "generated a cluster token in %s (readable only by you); engines on other machines need it: "
        "copy the file and pass --cluster-token-file, or set $%s",
        path,
        CLUSTER_TOKEN_ENV,
    )
    return token


def api_keys_from(keys: Iterable[str] | None) -> tuple[str, ...]:
    """The API keys to enforce: ``keys`` when given (an empty list: none), else ``$PARROT_API_KEY`` (if
    set). Keys are stripped; an empty one raises `ValueError` (it would admit a bare ``Bearer``)."""
    if keys is not None:
        given = tuple(k.strip() for k in keys)
        if not all(given):
            raise ValueError("an API key must not be empty")
        return given
    env = API_KEY.get()
    return (env,) if env else ()


# ------------------------------------------------------------------------------------------- checking
def bearer_token(authorization: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header value (None when absent or another scheme)."""
    if authorization is None or authorization[:7].lower() != "bearer ":
        return None
    return authorization[7:].strip() or None


def matches_any(presented: str, secrets_: Sequence[str]) -> bool:
    """Whether ``presented`` equals one of ``secrets_``; every one is compared (no early exit), each in
    constant time, so the timing tells nothing about which or how much matched."""
    candidate = presented.encode()
    found = False
    for secret in secrets_:
        found |= hmac.compare_digest(candidate, secret.encode())
    return found


def check_secret(token: str | None, accepted: Sequence[str], what: str, hint: str) -> None:
    """Raise `AuthError` unless ``token`` (None: none was sent) is one of ``accepted``: 401 without a
    token, 403 with a wrong one. ``what`` names the credential, ``hint`` says how to send it."""
    slug = what.lower().replace(" ", "_")
    if token is None:
        raise AuthError(f"this route needs the {what}: {hint}", 401, f"missing_{slug}")
    if not matches_any(token, accepted):
        raise AuthError(f"wrong {what}: {hint}", 403, f"invalid_{slug}")


Guard = Callable[[Request], Awaitable[None]]


def cluster_token_guard(token: str) -> Guard:
    """A FastAPI dependency admitting only requests that carry the cluster ``token``.

    ``async`` although it does no I/O: FastAPI would run a plain function on its thread pool.
    """

    async def require_cluster_token(request: Request) -> None:
        presented = bearer_token(request.headers.get("authorization"))
        check_secret(presented, (token,), "cluster token", CLUSTER_TOKEN_HINT)

    return header_guard(require_cluster_token)


def api_key_guard(keys: Sequence[str]) -> Guard:
    """A FastAPI dependency admitting only requests that carry one of ``keys`` (none: admits everything)."""
    accepted = tuple(keys)

    async def require_api_key(request: Request) -> None:
        request.state.tenant = check_api_key(request, accepted)

    return header_guard(require_api_key)


def presented_api_key(request: Request) -> str | None:
    """The API key a request carries: its ``X-API-Key`` header, else its bearer token."""
    return request.headers.get(API_KEY_HEADER) or bearer_token(request.headers.get("authorization"))


def check_api_key(request: Request, keys: Sequence[str]) -> str | None:
    """Raise `AuthError` unless ``request`` carries one of ``keys``; returns its tenant (`tenant_of`), or
    None when no keys are configured (every request passes, all one tenant)."""
    if not keys:
        return None
    key = presented_api_key(request)
    check_secret(key, keys, "API key", API_KEY_HINT)
    assert key is not None  # check_secret refuses a missing key
    return tenant_of(key)


def requester(request: Request) -> str:
    """Who sent ``request``, as quotas and fair turns count it: its tenant where the server has API keys
    (`check_api_key` set ``request.state.tenant``), else the client's address."""
    tenant: str | None = getattr(request.state, "tenant", None)
    return tenant or (request.client.host if request.client is not None else "")


def tenant_of(api_key: str) -> str:
    """The tenant an API key stands for, as logs, quotas and cache namespaces name it (a digest: never the
    key itself)."""
    return "tenant-" + hashlib.sha256(api_key.encode()).hexdigest()[:16]


def auth_error_response(exc: AuthError) -> JSONResponse:
    """``{"error": {"type", "message"}}`` with the status of ``exc``; a 401 names the scheme to use."""
    body = ErrorResponse(error=ErrorBody(type=exc.error_type, message=str(exc)))
    headers = {"WWW-Authenticate": "Bearer"} if exc.http_status == 401 else None
    return JSONResponse(body.model_dump(exclude_none=True), status_code=exc.http_status, headers=headers)


def install_auth_handler(app: FastAPI) -> None:
    """Answer `AuthError` on ``app`` with `auth_error_response`."""

    @app.exception_handler(AuthError)
    async def _auth(_: Request, exc: AuthError) -> JSONResponse:
        return auth_error_response(exc)
