"""Helpers for tests that run servers as real processes or on real ports: a free port, the URL a server
started with ``--port 0`` serves on, waiting until a server answers its health route, and stopping a process
for good."""

from __future__ import annotations

import re
import socket
import subprocess
import time
from collections.abc import Callable, Collection
from pathlib import Path

import httpx
import pytest


def free_port() -> int:
    """A TCP port nothing listens on now (on 127.0.0.1)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until(predicate: Callable[[], bool], timeout: float = 60.0, interval: float = 0.02) -> None:
    """Poll ``predicate`` until it holds; `TimeoutError` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not reached")
        time.sleep(interval)


def wait_healthy(
    proc: subprocess.Popen[bytes], url: str, timeout: float = 60.0, statuses: Collection[int] = (200,)
) -> None:
    """Wait until the server ``proc`` runs answers ``GET {url}/health`` with one of ``statuses`` (200: an
    engine serves; a manager with none in service answers 503); fail the test if it exits first or never
    answers."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"the server exited with status {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code in statuses:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    pytest.fail(f"the server at {url} did not come up within {timeout:g}s")


def spawn_logged(
    command: list[str], log: Path, env: dict[str, str], cwd: Path | None = None
) -> subprocess.Popen[bytes]:
    """Start ``command`` with its stdout and stderr both going to ``log`` (read it with `served_url`)."""
    with log.open("w") as out:
        return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd)


def served_url(proc: subprocess.Popen[bytes], log: Path, timeout: float = 60.0) -> str:
    """The URL the server ``proc`` (its stderr going to ``log``) says it serves on — the port it bound,
    also with ``--port 0``; fail the test if it exits first or never says."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = re.search(r"serving on (http://\S+)", log.read_text(errors="replace") if log.exists() else "")
        if found:
            return found[1]
        if proc.poll() is not None:
            pytest.fail(f"the server exited with status {proc.returncode}:\n{log.read_text()[-3000:]}")
        time.sleep(0.1)
    pytest.fail(f"the server logged no 'serving on' URL within {timeout:g}s:\n{log.read_text()[-3000:]}")


def stop(proc: subprocess.Popen[bytes], timeout: float = 30.0) -> None:
    """Terminate ``proc`` (killing it if it does not exit within ``timeout``)."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
