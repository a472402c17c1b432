"""Sessions: who may touch which variables, and when an idle session expires.

Pure bookkeeping over plain objects; the clock is passed in (`now`), so expiry is testable and the
simulator can drive it. The asyncio side (waiters, step tasks) lives in the manager.
"""

from __future__ import annotations

import secrets
import uuid
from dataclasses import dataclass, field

from server.serve.graph import SessionGraph


class SessionError(Exception):
    """A session-level refusal, with the HTTP status it maps to."""

    http_status = 400
    error_type = "session_error"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class UnauthorizedError(SessionError):
    http_status = 401
    error_type = "unauthorized"


class ForbiddenError(SessionError):
    http_status = 403
    error_type = "forbidden"


class UnknownSessionError(SessionError):
    http_status = 404
    error_type = "unknown_session"


@dataclass(eq=False)
class Session:
    """One application's namespace: its token, its dataflow graph, when it was last used."""

    session_id: str
    token: str
    graph: SessionGraph = field(default_factory=SessionGraph)
    last_seen: float = 0.0
    # Its prompts' KV is shared only with requests carrying the same salt (None: with everyone).
    cache_salt: str | None = None


class SessionTable:
    """Every live session; tokens are checked in constant time."""

    def __init__(self, ttl: float) -> None:
        self.ttl = ttl
        self._sessions: dict[str, Session] = {}

    def __len__(self) -> int:
        return len(self._sessions)

    def __iter__(self):
        return iter(list(self._sessions.values()))

    def create(self, now: float, cache_salt: str | None = None) -> Session:
        session = Session(uuid.uuid4().hex, secrets.token_urlsafe(24), last_seen=now, cache_salt=cache_salt)
        self._sessions[session.session_id] = session
        return session

    def authenticate(self, session_id: str, token: str | None, now: float) -> Session:
        """The session, if ``token`` is its bearer token; refreshes its expiry."""
        session = self._sessions.get(session_id)
        if token is None:
            raise UnauthorizedError(
                "missing 'Authorization: Bearer <token>' (the token of POST /v1/sessions)"
            )
        if session is None:
            # Do not tell a token holder of another session whether this id exists.
            if any(secrets.compare_digest(s.token, token) for s in self._sessions.values()):
                raise ForbiddenError(f"this token does not belong to session {session_id!r}")
            raise UnknownSessionError(
                f"session {session_id!r} does not exist (never created, expired or deleted)"
            )
        if not secrets.compare_digest(session.token, token):
            if any(secrets.compare_digest(s.token, token) for s in self._sessions.values()):
                raise ForbiddenError(f"this token does not belong to session {session_id!r}")
            raise UnauthorizedError(f"wrong token for session {session_id!r}")
        session.last_seen = now
        return session

    def remove(self, session_id: str) -> Session | None:
        return self._sessions.pop(session_id, None)

    def expired(self, now: float) -> list[Session]:
        """Sessions idle for longer than the TTL (not removed: the caller frees what they own first)."""
        return [s for s in self._sessions.values() if now - s.last_seen > self.ttl]
