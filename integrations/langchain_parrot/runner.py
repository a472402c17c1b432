"""Drivers: run compiled-chain programs, doing the I/O they ask for (sync or async).

A program (`Submission` + steps) is a generator that yields `Fetch` and `RunClient` requests. `Programs`
steps several of them together (a batch: one program per input) so that all their fetches of one round
go out together; `run_sync` and `run_async` are the two loops that answer the requests — with threads and
blocking ``get``s, or with ``await``. The session is opened here too (with retries and backoff when the
server is down or busy), so a chain whose server cannot be reached fails with an error naming its URL.

`in_session` / `in_session_async` run a whole run in a fresh session and hand its result back as soon as
it exists: deleting the session (which frees everything the run made on the server) then happens off the
caller's path, in the background — the one request of a run that nothing waits for.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import asynccontextmanager, contextmanager, suppress
from typing import Any, TypeVar

import parrot as P
from parrot.errors import ParrotError
from parrot.protocol import API_KEY_HEADER, Criteria

from langchain_parrot._http import ServerConnection
from langchain_parrot.submission import Effect, Fetch, Program, RunClient

__all__ = [
    "Programs",
    "in_session",
    "in_session_async",
    "open_session",
    "open_session_async",
    "run_async",
    "run_sync",
]

log = logging.getLogger(__name__)

# Most `get`s a sync run has in flight at once (one thread each).
_MAX_FETCH_THREADS = 32

T = TypeVar("T")

# Background session teardowns still running (a task must be referenced until it ends).
_TEARDOWNS: set[asyncio.Task[None]] = set()


class Programs:
    """Several programs stepped together; ``results[i]`` is program i's output or exception."""

    def __init__(self, programs: list[Program]) -> None:
        self._programs = programs
        self.waiting: dict[int, Effect] = {}
        self.results: list[Any] = [None] * len(programs)
        for i in range(len(programs)):
            self.resume(i)

    def resume(self, i: int, value: Any = None, error: BaseException | None = None) -> None:
        """Continue program ``i`` with the answer to its request (or raise ``error`` in it)."""
        self.waiting.pop(i, None)
        program = self._programs[i]
        try:
            effect = program.throw(error) if error is not None else program.send(value)
        except StopIteration as stop:
            self.results[i] = stop.value
        except Exception as e:  # this input failed; the others go on
            self.results[i] = e
        else:
            self.waiting[i] = effect

    def fetches(self) -> dict[Criteria | None, list[tuple[int, Fetch]]]:
        """The waiting fetches, by criteria."""
        groups: dict[Criteria | None, list[tuple[int, Fetch]]] = {}
        for i, effect in self.waiting.items():
            if isinstance(effect, Fetch):
                groups.setdefault(effect.criteria, []).append((i, effect))
        return groups

    def clients(self) -> list[tuple[int, RunClient]]:
        return [(i, e) for i, e in self.waiting.items() if isinstance(e, RunClient)]

    def deliver(self, requests: list[tuple[int, Fetch]], values: dict[int, Any]) -> None:
        """Answer fetches with the values (or errors) of their variables, by ``id(variable)``."""
        for i, fetch in requests:
            got = [values[id(v)] for v in fetch.variables]
            error = next((g for g in got if isinstance(g, BaseException)), None)
            self.resume(i, got if error is None else None, error)


def _unique(requests: list[tuple[int, Fetch]]) -> list[P.Variable]:
    return list({id(v): v for _, fetch in requests for v in fetch.variables}.values())


# ------------------------------------------------------------------------------------------------- sync
def _fetch_sync(
    variables: list[P.Variable], criteria: Criteria | None, timeout: float | None
) -> dict[int, Any]:
    def get(var: P.Variable) -> Any:
        try:
            return var.get(criteria=criteria, timeout=timeout)
        except Exception as e:
            return e

    if len(variables) == 1:  # one request carries the queued work and the wait
        return {id(variables[0]): get(variables[0])}
    # Send the queue once, so that the concurrent gets below find nothing left to send; if it fails, each
    # get raises its own variable's error.
    with suppress(ParrotError):
        variables[0].session.flush()
    with ThreadPoolExecutor(max_workers=min(_MAX_FETCH_THREADS, len(variables))) as pool:
        return dict(zip(map(id, variables), pool.map(get, variables), strict=True))


def run_sync(
    programs: list[Program],
    *,
    timeout: float | None,
    invoke: Callable[[RunClient, int], Any],
) -> list[Any]:
    """Run ``programs`` to the end; ``invoke(request, i)`` runs program i's client-side step."""
    state = Programs(programs)
    while state.waiting:
        for criteria, requests in state.fetches().items():
            state.deliver(requests, _fetch_sync(_unique(requests), criteria, timeout))
        for i, request in state.clients():
            try:
                state.resume(i, invoke(request, i))
            except Exception as e:
                state.resume(i, error=e)
    return state.results


@contextmanager
def open_session(connection: ServerConnection | None) -> Iterator[P.Session | None]:
    """A session on the connection's server (None: no session needed). Entering sends nothing: its first
    batch opens it, and a request that cannot connect is tried again ``max_retries`` times."""
    if connection is None:
        yield None
        return
    session = P.Session(
        connection.base_url,
        timeout=connection.timeout,  # type: ignore[arg-type]
        client=connection.client,
        connect_retries=connection.max_retries,
        api_key=connection.headers.get(API_KEY_HEADER),
    )
    session.__enter__()
    try:
        yield session
    except BaseException as e:
        session.__exit__(type(e), e, e.__traceback__)
        raise
    else:
        session.__exit__(None, None, None)


# ------------------------------------------------------------------------------------------------ async
async def _fetch_async(
    variables: list[P.Variable], criteria: Criteria | None, timeout: float | None
) -> dict[int, Any]:
    if len(variables) > 1:
        with suppress(ParrotError):
            await variables[0].session.aflush()
    got = await asyncio.gather(
        *(v.aget(criteria=criteria, timeout=timeout) for v in variables), return_exceptions=True
    )
    return dict(zip(map(id, variables), got, strict=True))


async def run_async(
    programs: list[Program],
    *,
    timeout: float | None,
    ainvoke: Callable[[RunClient, int], Any],
) -> list[Any]:
    """``await`` form of `run_sync`: fetches and client-side steps of one round run concurrently."""
    state = Programs(programs)
    while state.waiting:
        groups = list(state.fetches().items())
        clients = state.clients()
        fetched = await asyncio.gather(*(_fetch_async(_unique(r), c, timeout) for c, r in groups))
        outputs = await asyncio.gather(
            *(ainvoke(request, i) for i, request in clients), return_exceptions=True
        )
        for (_, requests), values in zip(groups, fetched, strict=True):
            state.deliver(requests, values)
        for (i, _), output in zip(clients, outputs, strict=True):
            if isinstance(output, BaseException):
                state.resume(i, error=output)
            else:
                state.resume(i, output)
    return state.results


@asynccontextmanager
async def open_session_async(connection: ServerConnection | None) -> AsyncIterator[P.Session | None]:
    """``async with`` form of `open_session`."""
    if connection is None:
        yield None
        return
    session = P.Session(
        connection.base_url,
        timeout=connection.timeout,  # type: ignore[arg-type]
        client=connection.async_client,
        connect_retries=connection.max_retries,
        api_key=connection.headers.get(API_KEY_HEADER),
    )
    await session.__aenter__()
    try:
        yield session
    except BaseException as e:
        await session.__aexit__(type(e), e, e.__traceback__)
        raise
    else:
        await session.__aexit__(None, None, None)


# ------------------------------------------------------------------------------------ session lifetimes
def in_session(connection: ServerConnection | None, work: Callable[[], T]) -> T:
    """``work()`` inside a fresh session (None: no session); returns as soon as ``work`` has.

    The session lives in a worker thread (a session is the current one of the thread that entered it),
    which deletes it after handing the result over. A failure to delete is only logged: the server
    expires idle sessions anyway.
    """
    if connection is None:
        return work()
    result: Future[T] = Future()

    def worker() -> None:
        try:
            with open_session(connection):
                result.set_result(work())
        except BaseException as e:
            if not result.done():
                result.set_exception(e)
            else:
                log.debug("deleting a Parrot session failed (it will expire): %s", e)

    threading.Thread(
        target=contextvars.copy_context().run, args=(worker,), name="parrot-run", daemon=True
    ).start()
    return result.result()


async def in_session_async(connection: ServerConnection | None, work: Callable[[], Awaitable[T]]) -> T:
    """``await`` form of `in_session`: the session lives in a task that deletes it after the result."""
    if connection is None:
        return await work()
    done: asyncio.Future[T] = asyncio.get_running_loop().create_future()

    async def worker() -> None:
        try:
            async with open_session_async(connection):
                done.set_result(await work())
        except BaseException as e:
            if not done.done():
                done.set_exception(e)
            else:
                log.debug("deleting a Parrot session failed (it will expire): %s", e)
            if isinstance(e, asyncio.CancelledError):
                raise

    task = asyncio.create_task(worker())
    _TEARDOWNS.add(task)
    task.add_done_callback(_TEARDOWNS.discard)
    try:
        return await done
    except asyncio.CancelledError:
        task.cancel()  # the caller gave up: stop the run (the session is deleted on the way out)
        raise
