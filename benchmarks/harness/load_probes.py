"""What the load tool reads off the server (`benchmarks.load`): a process's resident memory (now, and its
peak on a sampling thread) and the KV blocks in use on every engine (``GET /v1/engines``, with the
cluster token)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks.harness.load_server import HEARTBEAT_S, START_TIMEOUT_S


def rss_bytes(pid: int) -> int | None:
    """Resident set size of ``pid`` from /proc (None if it is gone or this is not Linux)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


class RssSampler:
    """The peak RSS of a process, sampled on a thread while a load runs."""

    def __init__(self, pid: int | None, every_s: float = 0.25) -> None:
        self.pid, self.every_s = pid, every_s
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> RssSampler:
        if self.pid is not None:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.peak = max(self.peak, rss_bytes(self.pid) or 0)  # type: ignore[arg-type]


def engines_status(url: str, token: str) -> list[dict[str, Any]]:
    """Every engine the manager at ``url`` knows (``GET /v1/engines``, with the cluster token)."""
    r = httpx.get(f"{url}/v1/engines", headers={"Authorization": f"Bearer {token}"}, timeout=30)
    r.raise_for_status()
    return list(r.json())


def wait_for_engines(url: str, token: str, count: int, timeout_s: float = START_TIMEOUT_S) -> None:
    """Wait until ``count`` engines are in service (TimeoutError after ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    while sum(e["alive"] for e in engines_status(url, token)) < count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"fewer than {count} engines in service after {timeout_s:.0f} s")
        time.sleep(0.5)


def blocks_in_use(url: str, token: str) -> int:
    """KV blocks in use on every engine in service (remote ones: as of their last heartbeat)."""
    return sum(e["stats"]["blocks_used"] for e in engines_status(url, token) if e["alive"])


def settled_blocks(url: str, token: str, wait_s: float = 4 * HEARTBEAT_S + 2) -> int:
    """Blocks in use once remote engines had time to heartbeat their stats (0 returns at once)."""
    deadline = time.monotonic() + wait_s
    blocks = blocks_in_use(url, token)
    while blocks and time.monotonic() < deadline:
        time.sleep(0.25)
        blocks = blocks_in_use(url, token)
    return blocks
