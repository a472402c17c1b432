"""`Session`: one server session and the queue of work not yet sent (its HTTP side: `parrot.session_http`).

Creating variables, setting them and calling semantic functions never block: each becomes an operation in
the session's queue. Variable ids are chosen here, so the whole queue — inputs, calls consuming each other's
outputs, and the ``get`` that wants a value — goes to the server as one ``POST /v1/sessions/{sid}/batch``:
a DAG of dependent calls costs one round trip per ``get``, and the calls run server-side.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Iterator
from contextvars import ContextVar, Token
from types import TracebackType
from typing import Any, Literal

import httpx

from parrot.errors import (
    ConnectionError as ParrotConnectionError,
    GetTimeoutError,
    NotFoundError,
    ParrotError,
)
from parrot.protocol import (
    API_KEY_ENV,
    CRITERIA,
    BatchApplied,
    BatchCreateVariable,
    BatchGet,
    BatchGetAnswer,
    BatchSetVariable,
    BatchSubmitCall,
    Criteria,
    GetVariableQuery,
    GetVariableResponse,
    SubmitCallRequest,
)
from parrot.session_http import SessionHTTP
from parrot.session_queue import CreateVariable, Deadline, QueuedOp, SetVariable, SubmitCall
from parrot.text_stream import TextFollower, stream_events
from parrot.urls import server_root
from parrot.variable import Variable

__all__ = ["Session", "current_session"]

_CURRENT: ContextVar[Session | None] = ContextVar("parrot_current_session", default=None)

# When a 200 "pending" answer comes back early (a server wait shorter than asked), poll again after this.
_REPOLL_S = 0.05
# One batch request carries at most this many operations / JSON bytes (the server takes 10k ops, 8 MiB).
_MAX_BATCH_OPS = 1000
_MAX_BATCH_BYTES = 4 * 1024 * 1024


def current_session() -> Session:
    """The innermost active session (``with``/``async with P.Session(...)``) of this context."""
    session = _CURRENT.get()
    if session is None:
        raise RuntimeError(
            "no active Parrot session: call semantic functions inside `with P.Session(url) as s:` "
            "(or `async with`)"
        )
    return session


class Session:
    """A session with a Parrot server: ``with P.Session(url) as s:`` or ``async with P.Session(url) as s:``.

    Entering makes it the current session of the context (semantic functions called inside submit to it)
    and chooses its id and secret token here, as variable ids are; the server creates the session with its
    first batch (the first ``get`` or `flush`), so opening a session costs no round trip of its own — and
    what would refuse it (a quota, a draining server, no server at all) is raised there. Leaving deletes it
    on the server, which frees all it owns. One httpx client is reused for every request: ``httpx.Client``
    in a ``with`` block, ``httpx.AsyncClient`` in an ``async with`` block, or the ``client`` you pass (not
    closed on exit).

    ``timeout`` bounds each ordinary request (seconds); ``poll_timeout`` is how long one long-poll request
    asks the server to wait when ``get`` has no timeout of its own. ``cache_salt``: the session's prompts
    share KV (prefix cache) only with calls and requests carrying the same salt; by default they share with
    everyone's, which is what makes a common system prompt cheap — and what lets another tenant tell, from a
    faster answer, that a prefix was sent before. ``connect_retries``: how many more times a request is tried
    when no connection to the server could be made (nothing was sent, so retrying is always safe), with
    backoff from 0.25 s. ``api_key``: the key a server started with ``--api-key`` needs to open a session
    (default: ``$PARROT_API_KEY``), sent as ``X-API-Key`` beside the session's own token.
    """

    def __init__(
        self,
        url: str,
        *,
        timeout: float = 30.0,
        poll_timeout: float = 30.0,
        client: httpx.Client | httpx.AsyncClient | None = None,
        cache_salt: str | None = None,
        connect_retries: int = 0,
        api_key: str | None = None,
    ) -> None:
        if connect_retries < 0:
            raise ValueError(f"connect_retries must be >= 0, got {connect_retries}")
        self.url = server_root(url)
        self.connect_retries = connect_retries
        self.timeout = timeout
        self.poll_timeout = poll_timeout
        self.cache_salt = cache_salt
        self._api_key = api_key if api_key is not None else (os.environ.get(API_KEY_ENV, "").strip() or None)
        self._given_client = client
        self._client: httpx.Client | httpx.AsyncClient | None = None
        self._http: SessionHTTP | None = None
        self._mode: Literal["sync", "async"] | None = None
        self._state: Literal["new", "open", "closed"] = "new"
        self._session_id: str | None = None
        self._token: str | None = None
        # Whether the server has the session: created by a batch it answered (`_created`), or maybe by one
        # whose answer was lost (`_sent`: leaving deletes it then, whatever the answer would have been).
        self._created = False
        self._sent = False
        self._context_token: Token[Session | None] | None = None
        self._pending: deque[QueuedOp] = deque()
        self._lock = threading.Lock()
        self._alock: asyncio.Lock | None = None

    @property
    def session_id(self) -> str | None:
        """The server's id of the session (None before entering)."""
        return self._session_id

    @property
    def view_url(self) -> str | None:
        """This session's live view (the server's ``/ui``: its DAG, each step's state, engine and sharing,
        values and streams), None before entering. The session's token rides in the link's fragment, which
        the browser never sends to a server; the page drops it from the address bar. Share it as the token.
        """
        if self._session_id is None or self._token is None:
            return None
        return f"{self.url}/ui#session={self._session_id}&token={self._token}"

    def __repr__(self) -> str:
        return f"<parrot.Session {self.url} id={self._session_id} {self._state}>"

    @property
    def _transport(self) -> SessionHTTP:
        if self._http is None:
            raise RuntimeError(f"the session is not open ({self!r}): use it inside its `with` block")
        return self._http

    # ------------------------------------------------------------------------------------ public API
    def variable(self, value: str | None = None, name: str | None = None) -> Variable:
        """A new variable of this session: set to ``value`` now, or pending until `Variable.set`.

        Lazy: it is created on the server with the next flush (a ``get``, or `flush`).
        """
        self._check_open()
        if value is not None and not isinstance(value, str):
            raise TypeError(f"a variable's value is text: got {type(value).__name__}; pass str(value)")
        var = Variable(self, name=name)
        var._has_value = value is not None
        self._pending.append(CreateVariable(var, value))
        return var

    def flush(self) -> None:
        """Send every queued operation now (sync sessions); ``get`` does this itself, in the same request.

        An operation the server rejects is dropped and its error raised (and raised again by ``get`` on the
        variables it would have made, and on those of queued calls consuming them); the operations before
        it are applied, the ones after it stay queued. After a connection error the queue is kept.
        """
        self._check_open("sync")
        while self._pending:
            self._send_batch(None)

    async def aflush(self) -> None:
        """``await`` form of `flush` (async sessions)."""
        self._check_open("async")
        while self._pending:
            await self._asend_batch(None)

    def _create_body(self) -> dict[str, str]:
        return {} if self.cache_salt is None else {"cache_salt": self.cache_salt}

    # --------------------------------------------------------------------------------- context managers
    def __enter__(self) -> Session:
        self._open("sync")
        self._started()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._leave()
        try:
            if self._sent:  # (a session no batch reached does not exist on the server)
                self._transport.request("DELETE", f"/v1/sessions/{self._session_id}", None)
        except NotFoundError:
            pass  # expired, already gone, or never created: nothing left to free
        except ParrotError:
            # (one the server never confirmed may not exist: if it does, it expires; the get said why)
            if exc_type is None and self._created:
                raise
        finally:
            self._close_client()

    async def __aenter__(self) -> Session:
        self._open("async")
        self._alock = asyncio.Lock()
        self._started()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._leave()
        try:
            if self._sent:
                await self._transport.arequest("DELETE", f"/v1/sessions/{self._session_id}", None)
        except NotFoundError:
            pass
        except ParrotError:
            if exc_type is None and self._created:
                raise
        finally:
            await self._aclose_client()

    def _open(self, mode: Literal["sync", "async"]) -> None:
        if self._state != "new":
            raise RuntimeError(f"a Session is entered once ({self!r}); make a new one")
        wanted = httpx.Client if mode == "sync" else httpx.AsyncClient
        given = self._given_client
        if given is not None and not isinstance(given, wanted):
            how = "`with`" if mode == "sync" else "`async with`"
            need = f"{wanted.__module__}.{wanted.__name__}"
            raise TypeError(f"{how} needs an {need} client, got {type(given).__name__}")
        self._mode = mode
        self._client = given if given is not None else wanted(timeout=self.timeout)
        self._http = SessionHTTP(self.url, self._client, self.timeout, self.connect_retries, self._api_key)

    def _started(self) -> None:
        # Chosen here (`BatchRequest.create`): a uuid4 id and a 256-bit token, sent only to this server.
        self._session_id, self._token = uuid.uuid4().hex, secrets.token_urlsafe(32)
        self._transport.token = self._token
        self._state = "open"
        self._context_token = _CURRENT.set(self)

    def _leave(self) -> None:
        self._state = "closed"
        self._pending.clear()
        if self._context_token is not None:
            _CURRENT.reset(self._context_token)
            self._context_token = None

    def _close_client(self) -> None:
        if self._given_client is None and isinstance(self._client, httpx.Client):
            self._client.close()

    async def _aclose_client(self) -> None:
        if self._given_client is None and isinstance(self._client, httpx.AsyncClient):
            await self._client.aclose()

    def _check_open(self, mode: Literal["sync", "async"] | None = None) -> None:
        if self._state != "open":
            raise RuntimeError(f"the session is not open ({self!r}): use it inside its `with` block")
        if mode == "sync" and self._mode == "async":
            raise RuntimeError("this session is async (`async with`): use `await var.aget()` / `aflush()`")
        if mode == "async" and self._mode == "sync":
            raise RuntimeError("this session is sync (`with`): use `var.get()` / `flush()`")

    # -------------------------------------------------------------------------------------- queue
    def _enqueue_set(self, var: Variable, value: str) -> None:
        self._check_open()
        self._pending.append(SetVariable(var, value))

    def _enqueue_call(
        self, func_name: str, request: SubmitCallRequest, inputs: dict[str, Variable], outputs: list[str]
    ) -> dict[str, Variable]:
        """Queue a call (built by a semantic function) and return its output variables by name."""
        self._check_open()
        for name, var in inputs.items():
            if var.session is not self:
                raise ValueError(
                    f"{func_name}(): input {name!r} is a variable of another session ({var.session!r}); "
                    "variables cannot cross sessions: pass its value (var.get()) instead"
                )
            if var._error is not None:
                raise ParrotError(
                    f"{func_name}(): input {name!r} comes from a request the server rejected: {var._error}"
                )
        made = {name: Variable(self, name=name, producer=func_name) for name in outputs}
        placeholders = []
        for spec in request.placeholders:
            bound = inputs.get(spec.name) if spec.role == "input" else made.get(spec.name)
            placeholders.append(spec if bound is None else spec.model_copy(update={"var_id": bound.var_id}))
        request = request.model_copy(update={"placeholders": placeholders})
        self._pending.append(SubmitCall(func_name, request, dict(inputs), made))
        return made

    def _batch_path(self) -> str:
        return f"/v1/sessions/{self._session_id}/batch"

    def _next_batch(self, get: BatchGet | None) -> tuple[int, dict[str, Any]]:
        """The body of the next batch: the first queued operations that fit (count, body). ``get`` rides
        along only when the batch empties the queue (it must come after every operation)."""
        ops: list[dict[str, Any]] = []
        size = 0
        for op in self._pending:
            body = self._op_body(op)
            # Large queues go in several requests, each under the server's body limit.
            n = len(json.dumps(body))
            if ops and (len(ops) >= _MAX_BATCH_OPS or size + n > _MAX_BATCH_BYTES):
                break
            ops.append(body)
            size += n
        request: dict[str, Any] = {"ops": ops}
        if get is not None and len(ops) == len(self._pending):
            request["get"] = get.model_dump(exclude_none=True)
        if not self._created:  # the server creates the session with this batch (or has, if it is a retry)
            request["create"] = self._create_body()
        self._sent = True
        return len(ops), request

    @staticmethod
    def _op_body(op: QueuedOp) -> dict[str, Any]:
        if isinstance(op, CreateVariable):
            created = BatchCreateVariable(var_id=op.var.var_id, name=op.var.name, value=op.value)
            return created.model_dump(exclude_none=True)
        if isinstance(op, SetVariable):
            return BatchSetVariable(var_id=op.var.var_id, value=op.value).model_dump()
        call = BatchSubmitCall(**op.request.model_dump())
        return call.model_dump(mode="json", exclude_none=True)

    def _send_batch(self, get: tuple[Variable, BatchGet] | None) -> None:
        """Send the next batch of queued operations (and ``get``, when it empties the queue); sync.

        The session lock is held only until the server's first answer line says the operations are
        applied — not while the get waits — so other threads' operations are never stuck behind a get.
        """
        with contextlib.ExitStack() as stack:
            with self._lock:
                if not self._pending:
                    return
                count, body = self._next_batch(get[1] if get is not None else None)
                try:
                    lines = stack.enter_context(self._transport.stream(self._batch_path(), body))
                    _batch_applied(next(lines, None))
                except ParrotError as e:
                    self._batch_failed(count, e)
                    raise
                self._batch_done(count)
            if get is not None and "get" in body:
                self._batch_answer(get[0], next(lines, None))

    async def _asend_batch(self, get: tuple[Variable, BatchGet] | None) -> None:
        """``async`` form of `_send_batch`."""
        assert self._alock is not None
        async with contextlib.AsyncExitStack() as stack:
            async with self._alock:
                if not self._pending:
                    return
                count, body = self._next_batch(get[1] if get is not None else None)
                try:
                    lines = await stack.enter_async_context(self._transport.astream(self._batch_path(), body))
                    _batch_applied(await anext(lines, None))
                except ParrotError as e:
                    self._batch_failed(count, e)
                    raise
                self._batch_done(count)
            if get is not None and "get" in body:
                self._batch_answer(get[0], await anext(lines, None))

    def _batch_done(self, count: int) -> None:
        """The first ``count`` queued operations were applied by the server."""
        self._created = True
        for _ in range(count):
            op = self._pending.popleft()
            if isinstance(op, CreateVariable):
                op.var._sent = True
            elif isinstance(op, SubmitCall):
                for var in op.outputs.values():
                    var._sent = True

    def _batch_failed(self, count: int, error: ParrotError) -> None:
        """Update the queue after a batch of ``count`` operations failed with ``error``."""
        if isinstance(error, ParrotConnectionError):
            return  # maybe not applied: keep everything for a retry
        if not self._created and error.op_index is None:
            return  # the session was not created (a quota, a draining server): nothing was applied
        index = error.op_index
        if index is None:
            if count != 1:
                return  # the batch as a whole was refused (auth, size): nothing was applied
            index = 0
        if index >= count:  # every operation was applied; the get itself was refused
            self._batch_done(count)
            return
        self._batch_done(index)  # applied before the failing one
        failed = self._pending.popleft()
        self._mark_failed(failed, error)

    def _mark_failed(self, op: QueuedOp, error: ParrotError) -> None:
        """Record ``error`` on what ``op`` makes, and drop the queued calls that consume it (transitively):
        the server would only reject them for naming a variable that does not exist."""
        lost: set[int] = set()
        if isinstance(op, CreateVariable):
            op.var._error = error
            lost.add(id(op.var))
        elif isinstance(op, SubmitCall):
            for var in op.outputs.values():
                var._error = error
                lost.add(id(var))
        kept: deque[QueuedOp] = deque()
        for queued in self._pending:
            consumes = isinstance(queued, SubmitCall) and any(id(v) in lost for v in queued.inputs.values())
            touches = isinstance(queued, SetVariable) and id(queued.var) in lost
            if not (consumes or touches):
                kept.append(queued)
            elif isinstance(queued, SubmitCall):
                for var in queued.outputs.values():
                    var._error = error
                    lost.add(id(var))
        self._pending = kept

    # --------------------------------------------------------------------------------------- get
    def _poll_plan(self, criteria: Criteria | None, timeout: float | None) -> Deadline:
        if criteria is not None and criteria not in CRITERIA:
            raise ValueError(f"criteria must be P.LATENCY or P.THROUGHPUT ({CRITERIA}), got {criteria!r}")
        if timeout is not None and timeout < 0:
            raise ValueError(f"timeout must be >= 0 seconds, got {timeout}")
        return Deadline(timeout)

    def _poll_request(
        self, var: Variable, criteria: Criteria | None, deadline: Deadline
    ) -> tuple[str, dict[str, Any], float]:
        """The path, query and wait (seconds) of one long-poll request."""
        if var._error is not None:
            raise var._error
        wait = deadline.left(self.poll_timeout)
        query = GetVariableQuery(criteria=criteria, timeout=round(wait, 3))
        path = f"/v1/sessions/{self._session_id}/variables/{var.var_id}"
        return path, query.model_dump(exclude_none=True), wait

    def _batch_get(self, var: Variable, criteria: Criteria | None, deadline: Deadline) -> BatchGet:
        """The ``get`` a batch carries for ``var`` (after checking the variable can be got at all)."""
        if var._error is not None:
            raise var._error
        wait = deadline.left(self.poll_timeout)
        return BatchGet(var_id=var.var_id, criteria=criteria, timeout=round(wait, 3))

    @staticmethod
    def _batch_answer(var: Variable, line: str | None) -> None:
        """Settle ``var`` from the batch's get line (missing or pending: the caller polls with GETs)."""
        if line is None:
            return
        answer = BatchGetAnswer.model_validate_json(line).get
        if answer.var_id == var.var_id and answer.status != "pending":
            var._settle(answer)

    def _get(self, var: Variable, criteria: Criteria | None, timeout: float | None) -> Any:
        self._check_open("sync")
        deadline = self._poll_plan(criteria, timeout)
        while var._settled is None and self._pending:  # the queue and this get: one request
            self._send_batch((var, self._batch_get(var, criteria, deadline)))
        while var._settled is None:
            path, params, wait = self._poll_request(var, criteria, deadline)
            try:
                data = self._transport.request("GET", path, None, params=params, wait=wait)
            except GetTimeoutError as e:
                # The server's 504 names the wait of this last poll (often ~0 s, what was left of the
                # timeout); the caller wants to hear about the timeout it gave.
                if deadline.passed():
                    raise deadline.error(var) from e
                continue
            answer = GetVariableResponse.model_validate(data)
            if answer.status != "pending":
                var._settle(answer)
            elif deadline.passed():
                raise deadline.error(var)
            else:
                time.sleep(_REPOLL_S)
        return var._result()

    async def _aget(self, var: Variable, criteria: Criteria | None, timeout: float | None) -> Any:
        if self._mode == "sync":
            return await asyncio.to_thread(self._get, var, criteria, timeout)
        self._check_open("async")
        deadline = self._poll_plan(criteria, timeout)
        while var._settled is None and self._pending:
            await self._asend_batch((var, self._batch_get(var, criteria, deadline)))
        while var._settled is None:
            path, params, wait = self._poll_request(var, criteria, deadline)
            try:
                data = await self._transport.arequest("GET", path, None, params=params, wait=wait)
            except GetTimeoutError as e:
                # The server's 504 names the wait of this last poll (often ~0 s, what was left of the
                # timeout); the caller wants to hear about the timeout it gave.
                if deadline.passed():
                    raise deadline.error(var) from e
                continue
            answer = GetVariableResponse.model_validate(data)
            if answer.status != "pending":
                var._settle(answer)
            elif deadline.passed():
                raise deadline.error(var)
            else:
                await asyncio.sleep(_REPOLL_S)
        return var._result()

    def _text(self, var: Variable, criteria: Criteria | None, timeout: float | None) -> Iterator[str]:
        """`Variable.stream`: the queue sent first (the variable must exist there), then the stream read,
        reconnecting until the variable settles or ``timeout`` passes."""
        self._check_open("sync")
        self.flush()
        deadline = self._poll_plan(criteria, timeout)
        follower = TextFollower(var._describe())
        while follower.final is None or var._settled is None:  # once at least: a late reader reads it all
            path, params, wait = self._poll_request(var, criteria, deadline)
            follower.reconnect()
            with self._transport.stream(path + "/stream", None, params, wait) as lines:
                for event in stream_events(lines):
                    if text := follower.feed(event):
                        yield text
            _after_text(var, follower.final, deadline)
        var._result()  # a failed variable raises, as get does

    async def _atext(
        self, var: Variable, criteria: Criteria | None, timeout: float | None
    ) -> AsyncIterator[str]:
        """``async`` form of `_text` (async sessions)."""
        self._check_open("async")
        await self.aflush()
        deadline = self._poll_plan(criteria, timeout)
        follower = TextFollower(var._describe())
        while follower.final is None or var._settled is None:
            path, params, wait = self._poll_request(var, criteria, deadline)
            follower.reconnect()
            async with self._transport.astream(path + "/stream", None, params, wait) as lines:
                async for line in lines:
                    for event in stream_events([line]):
                        if text := follower.feed(event):
                            yield text
            _after_text(var, follower.final, deadline)
        var._result()


def _after_text(var: Variable, final: GetVariableResponse | None, deadline: Deadline) -> None:
    """After one connection of a text stream: settle the variable from the server's answer, or raise at the
    deadline (else the caller reconnects)."""
    if final is not None and final.status != "pending":
        var._settle(final)
    elif deadline.passed():
        raise deadline.error(var)


def _batch_applied(line: str | None) -> BatchApplied:
    if line is None:
        raise ParrotError("the server's answer to a batch ended before saying its operations were applied")
    return BatchApplied.model_validate_json(line)
