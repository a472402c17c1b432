"""Transforms in worker processes, with a hard time limit: nothing a client sends can hold the manager.

`server.serve.transforms` bounds what it can from the inside (RE2's linear-time regexes, checks between
transforms and between regex matches), but a parser is one opaque call: a quadratic corner of a JSON repair
would run to its end, and a thread cannot be stopped. So the manager runs each call's transforms in a small
pool of worker processes (``python -m server.serve.transform_runner``). A worker reports each transform as
it starts; a transform still running ``limits.time_s`` later has its worker killed (SIGKILL) and replaced,
and the call fails with a `TransformLimitError` naming the time limit. Waiting for a worker happens on the
caller's thread with the GIL released, so the event loop never waits on a transform.

The manager calls `run_transforms` from a worker thread (``asyncio.to_thread``), exactly where it called
`apply_transforms`; results and errors are the same types.

Protocol (one JSON object per line; worker stdout is private to it: stray prints go to stderr):
worker -> ``{"event": "ready"}`` once imported; runner -> ``{"specs", "text", "limits"}``;
worker -> ``{"event": "start", "index", "type"}`` per transform, then ``{"event": "done", "value", "kind"}``
or ``{"event": "error", "error", "transform_type", "detail", ...}``. An error carries what the manager needs
to raise the same typed error the worker caught (`_error_message`, `_error_from`), the refused text
(``TransformError.text``, at most `transforms.MAX_REFUSED_TEXT_CHARS` characters) included.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import IO, Any

from parrot.protocol import TransformSpec
from pydantic import ValidationError

from server.serve.transforms import (
    DEFAULT_LIMITS,
    TransformError,
    TransformLimitError,
    TransformLimits,
    TransformPatternError,
    TransformResult,
    apply_transforms,
)

__all__ = ["DEFAULT_WORKERS", "TransformRunner", "default_runner", "run_transforms"]

# Transforms take milliseconds; two workers keep one slow call from queueing the others behind it.
DEFAULT_WORKERS = 2
# A worker imports langchain-core (about a second, more on a loaded machine); this is generous on purpose,
# and not charged to any transform's time limit.
WORKER_START_TIMEOUT_S = 60.0
_READ_CHUNK = 1 << 16
_PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # the folder holding `server` (site-packages, a checkout)


class _Worker:
    """One worker process and the line reader on its stdout."""

    def __init__(self, start_timeout_s: float) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "server.serve.transform_runner"],
            # `-m` puts the working directory first on sys.path: run where our own `server` package is, so
            # that a `server.py` in the user's directory (which `parrot-serve` is immune to) is not imported.
            cwd=_PACKAGE_ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            # Its own session: a Ctrl-C meant for the server does not kill workers mid-transform; they
            # exit on their own when the server's end of the pipe closes.
            start_new_session=True,
        )
        self._buffer = b""
        try:
            first = self.read(time.monotonic() + start_timeout_s)
        except BaseException:
            self.kill()
            raise
        if first is None or first.get("event") != "ready":
            self.kill()
            raise RuntimeError(f"transform worker did not start (it said {first!r})")

    def send(self, message: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(message).encode() + b"\n")
        self.proc.stdin.flush()

    def read(self, deadline: float) -> dict[str, Any] | None:
        """The next message, or None if ``deadline`` passes first; EOFError if the worker is gone."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            ready, _, _ = select.select([fd], [], [], remaining)
            if not ready:
                return None
            chunk = os.read(fd, _READ_CHUNK)
            if not chunk:
                raise EOFError(f"transform worker exited (status {self.proc.poll()})")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()
        self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                pipe.close()


class TransformRunner:
    """A pool of transform worker processes; `run` is thread-safe and blocks the calling thread only."""

    def __init__(
        self,
        workers: int = DEFAULT_WORKERS,
        limits: TransformLimits = DEFAULT_LIMITS,
        start_timeout_s: float = WORKER_START_TIMEOUT_S,
    ) -> None:
        if workers < 1:
            raise ValueError(f"a transform runner needs at least one worker, got {workers}")
        self.limits = limits
        self.start_timeout_s = start_timeout_s
        self.killed = 0  # workers killed for overrunning a time limit (for tests and metrics)
        self._slots = threading.BoundedSemaphore(workers)
        self._lock = threading.Lock()
        self._idle: list[_Worker] = []
        self._closed = False

    def run(
        self,
        specs: Sequence[TransformSpec | Mapping[str, Any]],
        text: str,
        limits: TransformLimits | None = None,
    ) -> TransformResult:
        """Apply ``specs`` to ``text`` in a worker, as `apply_transforms` does, each transform within
        ``limits`` (default: the runner's); a transform over its time limit is killed, not waited for."""
        if not specs:  # nothing that could run away: no round trip
            return apply_transforms((), text)
        limits = limits or self.limits
        request = {
            "specs": [s.model_dump() if isinstance(s, TransformSpec) else dict(s) for s in specs],
            "text": text,
            "limits": asdict(limits),
        }
        with self._slots:
            worker = self._take()
            try:
                outcome = self._exchange(worker, request, limits)
            except BaseException:
                worker.kill()  # overran, died, or we were interrupted: its state is unknown, never reuse it
                raise
            self._give_back(worker)
        if isinstance(outcome, Exception):  # the transform failed; the worker is fine
            raise outcome
        return outcome

    def close(self) -> None:
        """Stop every idle worker; later runs raise RuntimeError. (Busy ones stop when their run ends.)"""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for worker in idle:
            worker.kill()

    def _take(self) -> _Worker:
        with self._lock:
            if self._closed:
                raise RuntimeError("the transform runner is closed")
            while self._idle:
                worker = self._idle.pop()
                if worker.proc.poll() is None:
                    return worker
                worker.kill()  # died while idle (killed from outside): reap it and take another
        return _Worker(self.start_timeout_s)  # outside the lock: starting takes a while

    def _give_back(self, worker: _Worker) -> None:
        with self._lock:
            if not self._closed:
                self._idle.append(worker)
                return
        worker.kill()

    def _exchange(
        self, worker: _Worker, request: dict[str, Any], limits: TransformLimits
    ) -> TransformResult | Exception:
        """Run one request; a failed transform is returned, a worker that must go is raised."""
        try:
            worker.send(request)
        except BrokenPipeError as e:
            raise TransformError("transform", f"its worker process died ({e})") from e
        # Until the first transform starts the worker only parses and validates specs: bound that too.
        running = "transform"
        deadline = time.monotonic() + limits.time_s
        while True:
            try:
                message = worker.read(deadline)
            except EOFError as e:  # it crashed (out of memory, say): only this variable fails
                raise TransformError(running, f"its worker process died ({e})") from e
            if message is None:
                with self._lock:
                    self.killed += 1
                raise TransformLimitError(
                    running, "time", f"still running after {limits.time_s:g} s; stopped (worker killed)"
                )
            event = message["event"]
            if event == "start":
                running = message["type"]
                deadline = time.monotonic() + limits.time_s
            elif event == "done":
                value, kind = message["value"], message["kind"]
                return TransformResult(value, kind, json.loads(value) if kind == "json" else value)
            elif event == "error":
                return _error_from(message)
            else:
                raise RuntimeError(f"transform worker sent an unknown message: {message!r}")


def _error_from(message: dict[str, Any]) -> Exception:
    """Rebuild, in the manager, the typed error a worker reported."""
    kind = message["error"]
    if kind == "limit":
        return TransformLimitError(message["transform_type"], message["limit"], message["detail"])
    if kind == "pattern":
        return TransformPatternError(message["pattern"], message["reason"])
    if kind == "transform":
        # The constructor bounds the text again: the manager does not rely on the worker for its bound.
        return TransformError(message["transform_type"], message["detail"], text=message.get("text"))
    # A spec the manager should have refused at submit, or a bug in a parser: still only this variable fails.
    return TransformError(message.get("transform_type", "transform"), message["detail"])


def _error_message(e: Exception) -> dict[str, Any]:
    """What a worker sends for an exception out of `apply_transforms` (see `_error_from`)."""
    if isinstance(e, TransformLimitError):
        detail = e.message.removeprefix(f"{e.limit} limit exceeded: ")
        return {"error": "limit", "transform_type": e.transform_type, "limit": e.limit, "detail": detail}
    if isinstance(e, TransformPatternError):
        return {"error": "pattern", "pattern": e.pattern, "reason": e.reason}
    if isinstance(e, TransformError):
        return {"error": "transform", "transform_type": e.transform_type, "detail": e.message, "text": e.text}
    if isinstance(e, ValidationError):
        return {"error": "spec", "detail": f"invalid transform spec: {e}"}
    return {"error": "internal", "detail": f"internal error: {e!r}"}


_default: TransformRunner | None = None
_default_lock = threading.Lock()


def default_runner() -> TransformRunner:
    """The process-wide runner (started on first use, closed at exit), shared by every manager here."""
    global _default
    with _default_lock:
        if _default is None:
            _default = TransformRunner()
            atexit.register(_default.close)
        return _default


def run_transforms(
    specs: Sequence[TransformSpec | Mapping[str, Any]], text: str, limits: TransformLimits | None = None
) -> TransformResult:
    """`apply_transforms` in the default runner's worker processes, with the time limit enforced hard.

    Blocking (call it with ``asyncio.to_thread``); raises what `apply_transforms` raises.
    """
    return default_runner().run(specs, text, limits)


# ------------------------------------------------------------------------------------------ worker side
def _serve(stdin: IO[bytes], out: IO[bytes]) -> None:
    def send(message: dict[str, Any]) -> None:
        out.write(json.dumps(message).encode() + b"\n")  # ensure_ascii: lone surrogates survive the pipe
        out.flush()

    send({"event": "ready"})
    for line in stdin:
        request = json.loads(line)

        def started(index: int, transform_type: str) -> None:
            send({"event": "start", "index": index, "type": transform_type})

        try:
            limits = TransformLimits(**request["limits"])
            result = apply_transforms(request["specs"], request["text"], limits, on_start=started)
        except Exception as e:
            send({"event": "error", **_error_message(e)})
        else:
            send({"event": "done", "value": result.value, "kind": result.kind})


def main() -> None:
    """Worker process entry point: serve requests on stdin until it closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the manager decides when a worker stops
    # The protocol owns the real stdout; anything a library prints goes to stderr instead.
    out = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    _serve(sys.stdin.buffer, out)


if __name__ == "__main__":
    main()
