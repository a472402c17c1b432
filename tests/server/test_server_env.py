"""The servers' command lines run in their environment (`server.common.server_env`): CPython's objects on
glibc malloc (``PYTHONMALLOC=malloc``), so the memory of a burst of sessions goes back to the OS once it
ends, and OpenMP threads that wait passively (``OMP_WAIT_POLICY=PASSIVE``), so a co-tenant does not collapse
the engine."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from server.common import malloc_tuning, server_env as server_env_module
from server.common.cpu_budget import cpu_budget, quota_cores
from server.common.malloc_tuning import OBJECTS_ON_MALLOC, PYTHON_ALLOCATOR_ENV
from server.common.security import CLUSTER_TOKEN_ENV
from server.common.server_env import (
    PASSIVE,
    THREADS_ENV,
    WAIT_POLICY_ENV,
    restart_with_server_env,
    server_env,
)
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
    monkeypatch.setattr(server_env_module, "quota_cores", lambda: None)  # whatever the machine has
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
    monkeypatch.setattr(server_env_module, "quota_cores", lambda: None)  # whatever the machine has
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


def _cgroup(tmp_path: Path, proc: str, files: dict[str, str]) -> tuple[Path, Path]:
    """A fake cgroup mount under ``tmp_path`` with ``files`` (relative paths), and a /proc/self/cgroup."""
    root = tmp_path / "cgroup"
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    (tmp_path / "proc_cgroup").write_text(proc)
    return root, tmp_path / "proc_cgroup"


@pytest.mark.parametrize(
    ("proc", "files", "quota"),
    [
        ("0::/\n", {"cpu.max": "200000 100000\n"}, 2.0),  # v2, a container's own view
        ("0::/\n", {"cpu.max": "max 100000\n"}, None),
        ("0::/kubepods/pod1\n", {"kubepods/pod1/cpu.max": "150000 100000\n"}, 1.5),
        ("0::/gone\n", {"cpu.max": "300000 100000\n"}, 3.0),  # the path is not under the mount: its root
        (
            "4:memory:/\n3:cpu,cpuacct:/docker/abc\n",
            {
                "cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "400000\n",
                "cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000\n",
            },
            4.0,
        ),
        ("1:cpu:/\n", {"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),
        ("1:cpu:/\n", {}, None),  # nothing readable
    ],
)
def test_the_cgroup_quota_is_read_as_cores(
    tmp_path: Path, proc: str, files: dict[str, str], quota: float | None
) -> None:
    root, proc_cgroup = _cgroup(tmp_path, proc, files)
    assert quota_cores(root, proc_cgroup) == quota


@pytest.mark.parametrize(
    ("affinity", "quota", "threads"), [(64, 2.0, 2), (64, 1.5, 1), (64, 0.5, 1), (2, 8.0, 2), (8, None, 8)]
)
def test_threads_follow_the_quota_s_whole_cores_within_the_affinity(
    affinity: int, quota: float | None, threads: int
) -> None:
    assert cpu_budget(affinity, quota) == threads


def test_a_quota_below_the_affinity_sets_the_thread_count_unless_the_user_did(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(server_env_module, "affinity_cores", lambda: 64)
    monkeypatch.setattr(server_env_module, "quota_cores", lambda: 2.0)
    _unset(monkeypatch, THREADS_ENV)
    assert server_env()[THREADS_ENV] == "2"
    monkeypatch.setenv(THREADS_ENV, "4")  # the user's choice stands
    assert THREADS_ENV not in server_env()
    monkeypatch.setattr(server_env_module, "quota_cores", lambda: None)
    _unset(monkeypatch, THREADS_ENV)
    assert THREADS_ENV not in server_env()  # no quota: libgomp's own choice (the affinity)
