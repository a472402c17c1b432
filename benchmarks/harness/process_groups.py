"""Child processes that never outlive the benchmark: each leads a process group of its own (`start_group`),
which its children join, and the whole group is stopped (`stop_group`) when it is done with, when this
process exits, or when it gets SIGTERM or SIGINT.

A worker such as vLLM's starts engine processes of its own; killed alone, it would leave them orphaned,
holding cores (and memory) the next measurement needs.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Sequence
from types import FrameType
from typing import Any

import httpx

__all__ = ["GRACE_S", "start_group", "stop_group"]

GRACE_S = 3.0  # from SIGTERM to SIGKILL of a worker's group
_groups: dict[int, subprocess.Popen[str]] = {}  # live groups by id (= the leader's pid)
_replaced: dict[int, Any] = {}  # the signal handlers ours replaced while a group lives


def start_group(command: Sequence[str], **popen: Any) -> subprocess.Popen[str]:
    """``command`` as the leader of a new session: a process group its children join (unless they leave
    it), stopped whole by `stop_group` — or when this process exits or gets SIGTERM or SIGINT first, which
    would otherwise leave the children orphaned."""
    proc = subprocess.Popen(list(command), start_new_session=True, text=True, **popen)
    if not _groups and threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGTERM, signal.SIGINT):
            _replaced[signum] = signal.signal(signum, _on_signal)
    _groups[proc.pid] = proc
    return proc


def stop_group(proc: subprocess.Popen[str], grace_s: float = GRACE_S) -> None:
    """SIGTERM to every process of ``proc``'s group, SIGKILL to whatever is left after ``grace_s``; the
    leader reaped. Nothing to do for a group already gone."""
    _groups.pop(proc.pid, None)
    if not _groups:
        _restore_handlers()
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            proc.poll()  # reap the leader: a zombie still counts as a member of the group
            os.killpg(proc.pid, 0)  # ProcessLookupError once no member is left
            time.sleep(0.02)
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _restore_handlers() -> None:
    for signum, handler in _replaced.items():
        signal.signal(signum, handler)
    _replaced.clear()


def _stop_all() -> None:
    for proc in list(_groups.values()):
        stop_group(proc)


def _on_signal(signum: int, frame: FrameType | None) -> None:
    """Stop every group, then let the signal do what it did before (SIGINT: KeyboardInterrupt)."""
    previous = _replaced.get(signum, signal.SIG_DFL)
    _stop_all()
    if callable(previous):
        previous(signum, frame)
    elif previous == signal.SIG_DFL:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


atexit.register(_stop_all)


def wait_until_answers(
    proc: subprocess.Popen[Any], url: str, what: str, timeout_s: float, interval_s: float = 0.2
) -> None:
    """Return once ``GET url`` answers 200; `RuntimeError` naming ``what`` if ``proc`` exits first or
    ``timeout_s`` seconds pass."""
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with status {proc.returncode}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not answer {url} within {timeout_s:g} s")
        time.sleep(interval_s)
