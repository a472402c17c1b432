"""`Session`: one server session, its HTTP client, and the queue of work not yet sent.

Creating variables, setting them and calling semantic functions never block: each becomes an operation in
the session's queue, sent in order (one request each) by the next ``get`` or by `Session.flush`. A call's
inputs that are outputs of earlier calls travel as variable ids, so dependent calls run server-side and the
client waits only where it asks for a value.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from contextvars import ContextVar, Token
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Literal

import httpx

from parrot.errors import ConnectionError as ParrotConnectionError
from parrot.errors import (
    GetTimeoutError,
    NotFoundError,
    ParrotError,
    error_from_response,
    error_from_transport,
)
from parrot.protocol import (
    CRITERIA,
    CreateSessionResponse,
    CreateVariableRequest,
    Criteria,
    GetVariableQuery,
    GetVariableResponse,
    PlaceholderSpec,
    SetVariableRequest,
    SubmitCallRequest,
    SubmitCallResponse,
    VariableCreated,
)
from parrot.variable import Variable

__all__ = ["Session", "current_session"]

_CURRENT: ContextVar[Session | None] = ContextVar("parrot_current_session", default=None)

# When a 200 "pending" answer comes back early (a server wait shorter than asked), poll again after this.
_REPOLL_S = 0.05


def current_session() -> Session:
    """The innermost active session (``with``/``async with P.Session(...)``) of this context."""
    session = _CURRENT.get()
    if session is None:
        raise RuntimeError(
            "no active Parrot session: call semantic functions inside `with P.Session(url) as s:` "
            "(or `async with`)"
        )
    return session


@dataclass
class _CreateVariable:
    var: Variable
    value: str | None


@dataclass
class _SetVariable:
    var: Variable
    value: str


@dataclass
class _SubmitCall:
    func_name: str
    request: SubmitCallRequest  # inputs bound to variables have var_id None here: filled in when sent
    inputs: dict[str, Variable]
    outputs: dict[str, Variable]


_Op = _CreateVariable | _SetVariable | _SubmitCall


class Session:
    """A session with a Parrot server: ``with P.Session(url) as s:`` or ``async with P.Session(url) as s:``.

    Entering registers the session (``POST /v1/sessions``) and makes it the current session of the context
    (semantic functions called inside submit to it); leaving deletes it on the server, which frees all it
    owns. One httpx client is reused for every request: ``httpx.Client`` in a ``with`` block,
    ``httpx.AsyncClient`` in an ``async with`` block, or the ``client`` you pass (not closed on exit).

    ``timeout`` bounds each ordinary request (seconds); ``poll_timeout`` is how long one long-poll request
    asks the server to wait when ``get`` has no timeout of its own.
    """

    def __init__(
        self,
        url: str,
        *,
        timeout: float = 30.0,
        poll_timeout: float = 30.0,
        client: httpx.Client | httpx.AsyncClient | None = None,
    ) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"the server URL must start with http:// or https://, got {url!r}")
        self.url = url.rstrip("/")
        self.timeout = timeout
        self.poll_timeout = poll_timeout
        self._given_client = client
        self._client: httpx.Client | httpx.AsyncClient | None = None
        self._mode: Literal["sync", "async"] | None = None
        self._state: Literal["new", "open", "closed"] = "new"
        self._session_id: str | None = None
        self._token: str | None = None
        self._context_token: Token[Session | None] | None = None
        self._pending: deque[_Op] = deque()
        self._lock = threading.Lock()
        self._alock: asyncio.Lock | None = None

    @property
    def session_id(self) -> str | None:
        """The server's id of the session (None before entering)."""
        return self._session_id

    def __repr__(self) -> str:
        return f"<parrot.Session {self.url} id={self._session_id} {self._state}>"

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
        self._pending.append(_CreateVariable(var, value))
        return var

    def flush(self) -> None:
        """Send every queued operation now, in order (sync sessions). ``get`` does this itself.

        An operation the server rejects is dropped and its error raised (and raised again by ``get`` on
        the variables it would have made); after a connection error the queue is kept for a retry.
        """
        self._check_open("sync")
        with self._lock:
            while self._pending:
                op = self._pending[0]
                try:
                    method, path, body = self._prepare(op)
                    data = self._request(method, path, body)
                except ParrotError as e:
                    self._drop(op, e)
                    raise
                self._pending.popleft()
                self._complete(op, data)

    async def aflush(self) -> None:
        """``await`` form of `flush` (async sessions)."""
        self._check_open("async")
        assert self._alock is not None
        async with self._alock:
            while self._pending:
                op = self._pending[0]
                try:
                    method, path, body = self._prepare(op)
                    data = await self._arequest(method, path, body)
                except ParrotError as e:
                    self._drop(op, e)
                    raise
                self._pending.popleft()
                self._complete(op, data)

    # --------------------------------------------------------------------------------- context managers
    def __enter__(self) -> Session:
        self._open("sync")
        try:
            data = self._request("POST", "/v1/sessions", None, auth=False)
        except BaseException:
            self._close_client()
            raise
        self._started(data)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._leave()
        try:
            self._request("DELETE", f"/v1/sessions/{self._session_id}", None)
        except NotFoundError:
            pass  # expired or already gone: nothing left to free
        except ParrotError:
            if exc_type is None:
                raise
        finally:
            self._close_client()

    async def __aenter__(self) -> Session:
        self._open("async")
        self._alock = asyncio.Lock()
        try:
            data = await self._arequest("POST", "/v1/sessions", None, auth=False)
        except BaseException:
            await self._aclose_client()
            raise
        self._started(data)
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._leave()
        try:
            await self._arequest("DELETE", f"/v1/sessions/{self._session_id}", None)
        except NotFoundError:
            pass
        except ParrotError:
            if exc_type is None:
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

    def _started(self, data: Any) -> None:
        created = CreateSessionResponse.model_validate(data)
        self._session_id, self._token = created.session_id, created.token
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
        self._pending.append(_SetVariable(var, value))

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
        self._pending.append(_SubmitCall(func_name, request, dict(inputs), made))
        return made

    def _prepare(self, op: _Op) -> tuple[str, str, dict[str, Any]]:
        """The request that sends ``op``: method, path under the server URL, JSON body."""
        base = f"/v1/sessions/{self._session_id}"
        if isinstance(op, _CreateVariable):
            body = CreateVariableRequest(name=op.var.name, value=op.value)
            return "POST", f"{base}/variables", body.model_dump(exclude_none=True)
        if isinstance(op, _SetVariable):
            return "PUT", f"{base}/variables/{op.var.var_id}", SetVariableRequest(value=op.value).model_dump()
        placeholders: list[PlaceholderSpec] = []
        for spec in op.request.placeholders:
            var = op.inputs.get(spec.name)
            if var is not None:
                if var._error is not None or var.var_id is None:
                    raise ParrotError(
                        f"{op.func_name}(): input {spec.name!r} comes from a request the server "
                        f"rejected: {var._error}"
                    )
                spec = spec.model_copy(update={"var_id": var.var_id})
            placeholders.append(spec)
        request = op.request.model_copy(update={"placeholders": placeholders})
        return "POST", f"{base}/calls", request.model_dump(mode="json", exclude_none=True)

    def _complete(self, op: _Op, data: Any) -> None:
        if isinstance(op, _CreateVariable):
            op.var._var_id = VariableCreated.model_validate(data).var_id
        elif isinstance(op, _SubmitCall):
            outputs = SubmitCallResponse.model_validate(data).outputs
            for name, var in op.outputs.items():
                if name not in outputs:
                    raise ParrotError(f"the server's answer to {op.func_name}() lacks output {name!r}")
                var._var_id = outputs[name]

    def _drop(self, op: _Op, error: ParrotError) -> None:
        """Remove a rejected operation (kept after a connection error, to retry) and mark what it makes."""
        if isinstance(error, ParrotConnectionError):
            return
        self._pending.popleft()
        if isinstance(op, _CreateVariable):
            op.var._error = error
        elif isinstance(op, _SubmitCall):
            for var in op.outputs.values():
                var._error = error

    # --------------------------------------------------------------------------------------- get
    def _poll_plan(self, criteria: Criteria | None, timeout: float | None) -> float | None:
        if criteria is not None and criteria not in CRITERIA:
            raise ValueError(f"criteria must be P.LATENCY or P.THROUGHPUT ({CRITERIA}), got {criteria!r}")
        if timeout is not None and timeout < 0:
            raise ValueError(f"timeout must be >= 0 seconds, got {timeout}")
        return None if timeout is None else time.monotonic() + timeout

    def _poll_request(
        self, var: Variable, criteria: Criteria | None, deadline: float | None
    ) -> tuple[str, dict[str, Any], float]:
        """The path, query and wait (seconds) of one long-poll request."""
        if var._error is not None:
            raise var._error
        wait = self.poll_timeout if deadline is None else max(0.0, deadline - time.monotonic())
        query = GetVariableQuery(criteria=criteria, timeout=round(wait, 3))
        path = f"/v1/sessions/{self._session_id}/variables/{var.var_id}"
        return path, query.model_dump(exclude_none=True), wait

    @staticmethod
    def _timed_out(var: Variable, deadline: float | None) -> GetTimeoutError | None:
        if deadline is not None and time.monotonic() >= deadline:
            return GetTimeoutError(f"{var._describe()} is still pending", status=504)
        return None

    def _get(self, var: Variable, criteria: Criteria | None, timeout: float | None) -> Any:
        self._check_open("sync")
        deadline = self._poll_plan(criteria, timeout)
        if var._settled is None:
            self.flush()
        while var._settled is None:
            path, params, wait = self._poll_request(var, criteria, deadline)
            try:
                data = self._request("GET", path, None, params=params, wait=wait)
            except GetTimeoutError:
                if deadline is not None and time.monotonic() >= deadline:
                    raise
                continue
            answer = GetVariableResponse.model_validate(data)
            if answer.status != "pending":
                var._settle(answer)
            elif error := self._timed_out(var, deadline):
                raise error
            else:
                time.sleep(_REPOLL_S)
        return var._result()

    async def _aget(self, var: Variable, criteria: Criteria | None, timeout: float | None) -> Any:
        if self._mode == "sync":
            return await asyncio.to_thread(self._get, var, criteria, timeout)
        self._check_open("async")
        deadline = self._poll_plan(criteria, timeout)
        if var._settled is None:
            await self.aflush()
        while var._settled is None:
            path, params, wait = self._poll_request(var, criteria, deadline)
            try:
                data = await self._arequest("GET", path, None, params=params, wait=wait)
            except GetTimeoutError:
                if deadline is not None and time.monotonic() >= deadline:
                    raise
                continue
            answer = GetVariableResponse.model_validate(data)
            if answer.status != "pending":
                var._settle(answer)
            elif error := self._timed_out(var, deadline):
                raise error
            else:
                await asyncio.sleep(_REPOLL_S)
        return var._result()

    # ------------------------------------------------------------------------------------------ HTTP
    def _request_args(
        self, body: dict[str, Any] | None, params: dict[str, Any] | None, wait: float, auth: bool
    ) -> dict[str, Any]:
        headers = {"Authorization": f"Bearer {self._token}"} if auth else {}
        # A long poll may legitimately take `wait` seconds before the answer starts.
        return {"json": body, "params": params, "headers": headers, "timeout": self.timeout + wait}

    def _request(
        self,
        method: str,
        path: str,
        body: dict[str, Any] | None,
        *,
        params: dict[str, Any] | None = None,
        wait: float = 0.0,
        auth: bool = True,
    ) -> Any:
        assert isinstance(self._client, httpx.Client)
        url = self.url + path
        try:
            response = self._client.request(method, url, **self._request_args(body, params, wait, auth))
        except httpx.TransportError as e:
            raise error_from_transport(e, url) from e
        return _answer(response)

    async def _arequest(
        self,
        method: str,
        path: str,
        body: dict[str, Any] | None,
        *,
        params: dict[str, Any] | None = None,
        wait: float = 0.0,
        auth: bool = True,
    ) -> Any:
        assert isinstance(self._client, httpx.AsyncClient)
        url = self.url + path
        try:
            response = await self._client.request(method, url, **self._request_args(body, params, wait, auth))
        except httpx.TransportError as e:
            raise error_from_transport(e, url) from e
        return _answer(response)


def _answer(response: httpx.Response) -> Any:
    if not response.is_success:
        raise error_from_response(response)
    if not response.content:
        return None
    try:
        return response.json()
    except ValueError as e:
        raise ParrotError(f"the server answered {response.request.url} with non-JSON text: {e}") from None
