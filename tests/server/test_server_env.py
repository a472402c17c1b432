"""The servers' command lines run in their environment (`server.common.server_env`): CPython's objects on
glibc malloc (``PYTHONMALLOC=malloc``), so the memory of a burst of sessions goes back to the OS once it
ends, and OpenMP threads that wait passively (``OMP_WAIT_POLICY=PASSIVE``), so a co-tenant does not collapse
the engine."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from server.common import malloc_tuning
from server.common.malloc_tuning import OBJECTS_ON_MALLOC, PYTHON_ALLOCATOR_ENV
from server.common.security import CLUSTER_TOKEN_ENV
from server.common.server_env import PASSIVE, WAIT_POLICY_ENV, restart_with_server_env
from tests.processes import served_url, spawn_logged, stop, wait_healthy

ROOT = Path(__file__).resolve().parents[2]
linux_glibc = pytest.mark.skipif(
    malloc_tuning._libc() is None or not sys.platform.startswith("linux"), reason="glibc on Linux only"
)


def _unset(monkeypatch: pytest.MonkeyPatch, *names: str) -> None:
    for name in names:
        monkeypatch.setenv(name, "")  # recorded, so what the call sets is undone after the test
        monkeypatch.delenv(name)


def test_the_process_is_re_executed_with_the_same_command_line(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, list[str]]] = []
    _unset(monkeypatch, PYTHON_ALLOCATOR_ENV, WAIT_POLICY_ENV)
    monkeypatch.setattr(sys, "orig_argv", [sys.executable, "-m", "server", "--port", "9000"])
    monkeypatch.setattr(os, "execv", lambda path, args: calls.append((path, args)))
    monkeypatch.setattr(malloc_tuning, "_libc", lambda: type("Glibc", (), {"malloc_trim": None})())
    restart_with_server_env()
    assert calls == [(sys.executable, [sys.executable, "-m", "server", "--port", "9000"])]
    assert os.environ[PYTHON_ALLOCATOR_ENV] == OBJECTS_ON_MALLOC and os.environ[WAIT_POLICY_ENV] == PASSIVE


@pytest.mark.parametrize("why", ["set", "no glibc"])
def test_the_users_values_stand_and_a_missing_glibc_changes_only_the_wait_policy(
    monkeypatch: pytest.MonkeyPatch, why: str
) -> None:
    calls: list[list[str]] = []
    monkeypatch.setattr(os, "execv", lambda path, args: calls.append(args))
    if why == "set":  # the user's choices stand: nothing to re-execute for
        monkeypatch.setenv(PYTHON_ALLOCATOR_ENV, "pymalloc")
        monkeypatch.setenv(WAIT_POLICY_ENV, "ACTIVE")
    else:
        _unset(monkeypatch, PYTHON_ALLOCATOR_ENV, WAIT_POLICY_ENV)
        monkeypatch.setattr(malloc_tuning, "_libc", lambda: None)
    restart_with_server_env()
    assert os.environ.get(PYTHON_ALLOCATOR_ENV) == ("pymalloc" if why == "set" else None)
    assert os.environ[WAIT_POLICY_ENV] == ("ACTIVE" if why == "set" else PASSIVE)
    assert len(calls) == (0 if why == "set" else 1)


@linux_glibc
def test_python_m_server_runs_in_the_server_environment(tmp_path: Path) -> None:
    """End to end: the served process (same pid after the re-exec) has the variable, and serves."""
    log = tmp_path / "server.log"
    env = {k: v for k, v in os.environ.items() if k not in (PYTHON_ALLOCATOR_ENV, WAIT_POLICY_ENV)}
    env[CLUSTER_TOKEN_ENV] = "t" * 32
    proc = spawn_logged([sys.executable, "-m", "server", "--engines", "0", "--port", "0"], log, env, ROOT)
    try:
        url = served_url(proc, log)
        wait_healthy(proc, url, statuses=(503,))
        environ = Path(f"/proc/{proc.pid}/environ").read_bytes().split(b"\0")
        assert f"{PYTHON_ALLOCATOR_ENV}={OBJECTS_ON_MALLOC}".encode() in environ
        assert f"{WAIT_POLICY_ENV}={PASSIVE}".encode() in environ
    finally:
        stop(proc)
