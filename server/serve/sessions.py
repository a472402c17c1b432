"""Sessions: who may touch which variables, and when an idle session expires.

Pure bookkeeping over plain objects; the clock is passed in (`now`), so expiry is testable and the
simulator can drive it. The asyncio side (waiters, step tasks) lives in the manager.
"""

from __future__ import annotations

import hashlib
import re
import secrets
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from parrot.protocol import SESSION_ID_PATTERN, SESSION_TOKEN_PATTERN

from server.serve.graph import SessionGraph
from server.serve.ir import CallOutline


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


class SessionConflictError(SessionError):
    """A client-chosen session id or token that is in use already."""

    http_status = 409
    error_type = "session_conflict"


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
    created_at: float = 0.0
    # Every call submitted, in order, as ids (the graph keeps only pending steps; the live view shows them
    # all). Bounded: each call has an output, and a session's variables are (quotas.variables_per_session).
    calls: list[CallOutline] = field(default_factory=list)
    # Its prompts' KV is shared only with requests carrying the same salt (None: with everyone).
    cache_salt: str | None = None
    client: str = ""  # who created it: its tenant (an API key's), else its address (quota and fair share)
    waiters: int = 0  # requests of its client waiting on it now (a long-poll get): it is not idle
    queued_tokens: int = 0  # max_tokens of its unfinished steps, as of the last quota check (an estimate)
    stored_chars: int = 0  # characters of the values its client set (kept while the session lives)


class SessionTable:
    """Every live session. A token finds its session in O(1) through its SHA-256 digest (so the lookup's
    timing says nothing about the token), and is then compared in constant time."""

    def __init__(self, ttl: float) -> None:
        self.ttl = ttl
        self._sessions: dict[str, Session] = {}
        self._by_token: dict[bytes, str] = {}  # sha256(token) -> session id
        self._by_client: dict[str, set[str]] = {}  # client -> its sessions' ids
        self._stored: Counter[str] = Counter()  # client -> characters its sessions' set values hold
        self._queued: Counter[str] = Counter()  # client -> its sessions' `queued_tokens` summed

    def __len__(self) -> int:
        return len(self._sessions)

    def __iter__(self) -> Iterator[Session]:
        return iter(list(self._sessions.values()))

    def open_by(self, client: str) -> int:
        """Sessions ``client`` has open now."""
        return len(self._by_client.get(client, ()))

    def of(self, client: str) -> list[Session]:
        """The sessions ``client`` has open now."""
        return [self._sessions[i] for i in self._by_client.get(client, ())]

    def stored_by(self, client: str) -> int:
        """Characters of the values ``client``'s open sessions were given (`store`)."""
        return self._stored[client]

    def queued_by(self, client: str) -> int:
        """``client``'s sessions' `queued_tokens` estimates, summed (`set_queued`)."""
        return self._queued[client]

    def set_queued(self, session: Session, tokens: int) -> None:
        """Set ``session``'s estimate of what its unfinished steps may generate (and its client's sum)."""
        self._queued[session.client] += tokens - session.queued_tokens
        session.queued_tokens = tokens

    def store(self, session: Session, chars: int) -> None:
        """Count ``chars`` more characters of values set in ``session`` against its client."""
        session.stored_chars += chars
        self._stored[session.client] += chars

    def __contains__(self, session_id: object) -> bool:
        return session_id in self._sessions

    def create(
        self,
        now: float,
        cache_salt: str | None = None,
        client: str = "",
        *,
        session_id: str | None = None,
        token: str | None = None,
    ) -> Session:
        """A new session: a fresh id and token, or the client's own (`BatchRequest.create`: checked against
        the protocol's patterns — 400 — and against the ones in use — 409)."""
        if (session_id is None) != (token is None):
            raise ValueError("give both a session id and its token, or neither")
        if session_id is not None and token is not None:
            _check_chosen(session_id, token)
            if session_id in self._sessions or _digest(token) in self._by_token:
                raise SessionConflictError(
                    "this session id or token is in use: choose new ones (uuid4().hex, token_urlsafe(32))"
                )
        session = Session(
            session_id or uuid.uuid4().hex,
            token or secrets.token_urlsafe(24),
            last_seen=now,
            created_at=now,
            cache_salt=cache_salt,
            client=client,
        )
        self._sessions[session.session_id] = session
        self._by_token[_digest(session.token)] = session.session_id
        self._by_client.setdefault(client, set()).add(session.session_id)
        return session

    def authenticate(self, session_id: str, token: str | None, now: float) -> Session:
        """The session, if ``token`` is its bearer token; refreshes its expiry."""
        if token is None:
            raise UnauthorizedError(
                "missing 'Authorization: Bearer <token>' (the token of POST /v1/sessions)"
            )
        session = self._sessions.get(session_id)
        if session is None or not secrets.compare_digest(session.token, token):
            # Do not tell a token holder of another session whether this id exists.
            if self._by_token.get(_digest(token)) is not None:
                raise ForbiddenError(f"this token does not belong to session {session_id!r}")
            if session is None:
                raise _unknown(session_id)
            raise UnauthorizedError(f"wrong token for session {session_id!r}")
        session.last_seen = now
        return session

    @contextmanager
    def waiting(self, session: Session, clock: Callable[[], float]) -> Iterator[None]:
        """Mark ``session`` busy while its client waits on it (a long-poll get): a session is idle only
        when nobody waits on it, so the reaper never deletes one under a waiting request."""
        session.waiters += 1
        try:
            yield
        finally:
            session.waiters -= 1
            session.last_seen = max(session.last_seen, clock())  # idle from when the wait ended

    def find(self, session_id: str) -> Session:
        """The session ``session_id`` for a caller already authorised otherwise (the cluster token): no
        token check, and its expiry is not refreshed (looking at a session does not keep it alive)."""
        session = self._sessions.get(session_id)
        if session is None:
            raise _unknown(session_id)
        return session

    def remove(self, session_id: str) -> Session | None:
        session = self._sessions.pop(session_id, None)
        if session is not None:
            self._by_token.pop(_digest(session.token), None)
            ids = self._by_client[session.client]
            ids.discard(session_id)
            if not ids:
                del self._by_client[session.client]
            for counts, held in ((self._stored, session.stored_chars), (self._queued, session.queued_tokens)):
                counts[session.client] -= held
                if counts[session.client] <= 0:
                    del counts[session.client]
        return session

    def expired(self, now: float) -> list[Session]:
        """Sessions idle for longer than the TTL, none waited on (not removed: the caller frees what they
        own first)."""
        return [s for s in self._sessions.values() if s.waiters == 0 and now - s.last_seen > self.ttl]


def _unknown(session_id: str) -> UnknownSessionError:
    return UnknownSessionError(f"session {session_id!r} does not exist (never created, expired or deleted)")


def _check_chosen(session_id: str, token: str) -> None:
    if not re.fullmatch(SESSION_ID_PATTERN, session_id):
        raise SessionError(f"a session id chosen by the client must match {SESSION_ID_PATTERN}")
    if not re.fullmatch(SESSION_TOKEN_PATTERN, token):
        raise SessionError(
            f"a session token chosen by the client must match {SESSION_TOKEN_PATTERN} (a secret of at least "
            "256 bits: secrets.token_urlsafe(32))"
        )


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()
