"""The servers' command lines run with CPython's objects on glibc malloc (``PYTHONMALLOC=malloc``), so the
memory of a burst of sessions goes back to the OS once it ends (`server.common.malloc_tuning`)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from server.common import malloc_tuning
from server.common.malloc_tuning import (
    OBJECTS_ON_MALLOC,
    PYTHON_ALLOCATOR_ENV,
    restart_with_objects_on_malloc,
)
from server.common.security import CLUSTER_TOKEN_ENV
from tests.processes import served_url, spawn_logged, stop, wait_healthy

ROOT = Path(__file__).resolve().parents[2]
linux_glibc = pytest.mark.skipif(
    malloc_tuning._libc() is None or not sys.platform.startswith("linux"), reason="glibc on Linux only"
)


def test_the_process_is_re_executed_with_the_same_command_line(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, list[str]]] = []
    monkeypatch.setenv(PYTHON_ALLOCATOR_ENV, "")  # recorded, so what the call sets is undone after the test
    monkeypatch.delenv(PYTHON_ALLOCATOR_ENV)
    monkeypatch.setattr(sys, "orig_argv", [sys.executable, "-m", "server", "--port", "9000"])
    monkeypatch.setattr(os, "execv", lambda path, args: calls.append((path, args)))
    monkeypatch.setattr(malloc_tuning, "_libc", lambda: type("Glibc", (), {"malloc_trim": None})())
    restart_with_objects_on_malloc()
    assert calls == [(sys.executable, [sys.executable, "-m", "server", "--port", "9000"])]
    assert os.environ[PYTHON_ALLOCATOR_ENV] == OBJECTS_ON_MALLOC


@pytest.mark.parametrize("why", ["set", "no glibc"])
def test_nothing_happens_when_the_variable_is_set_or_there_is_no_glibc(
    monkeypatch: pytest.MonkeyPatch, why: str
) -> None:
    monkeypatch.setattr(os, "execv", lambda *a: pytest.fail("re-executed"))
    if why == "set":
        monkeypatch.setenv(PYTHON_ALLOCATOR_ENV, "pymalloc")  # the user's choice stands
    else:
        monkeypatch.setenv(PYTHON_ALLOCATOR_ENV, "")
        monkeypatch.delenv(PYTHON_ALLOCATOR_ENV)
        monkeypatch.setattr(malloc_tuning, "_libc", lambda: None)
    restart_with_objects_on_malloc()
    assert os.environ.get(PYTHON_ALLOCATOR_ENV) == ("pymalloc" if why == "set" else None)


@linux_glibc
def test_python_m_server_runs_with_objects_on_malloc(tmp_path: Path) -> None:
    """End to end: the served process (same pid after the re-exec) has the variable, and serves."""
    log = tmp_path / "server.log"
    env = {k: v for k, v in os.environ.items() if k != PYTHON_ALLOCATOR_ENV}
    env[CLUSTER_TOKEN_ENV] = "t" * 32
    proc = spawn_logged([sys.executable, "-m", "server", "--engines", "0", "--port", "0"], log, env, ROOT)
    try:
        url = served_url(proc, log)
        wait_healthy(proc, url, statuses=(503,))
        environ = Path(f"/proc/{proc.pid}/environ").read_bytes().split(b"\0")
        assert f"{PYTHON_ALLOCATOR_ENV}={OBJECTS_ON_MALLOC}".encode() in environ
    finally:
        stop(proc)
