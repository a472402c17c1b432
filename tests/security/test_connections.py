"""Connection hygiene, on a server process (``python -m server``) and on `launch`'s in-process server: a
request head that trickles in (slowloris) is closed after ``--head-timeout``; connections beyond
``--max-connections-per-client`` from one address are answered 503 and closed; the server keeps answering
everyone else."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest

from server.common.connection_limits import ConnectionLimits
from server.launcher import launch
from tests.processes import free_port, stop, wait_healthy

HEAD_TIMEOUT = 1.0
CAP = 12


@pytest.fixture(scope="module", params=["process", "launch"])
def url(request: pytest.FixtureRequest) -> Iterator[str]:
    if request.param == "launch":
        limits = ConnectionLimits(head_timeout_s=HEAD_TIMEOUT, max_per_client=CAP)
        with launch("tiny", connection_limits=limits) as served:
            yield served.url
        return
    port = free_port()
    command = [sys.executable, "-m", "server", "--model", "tiny", "--port", str(port)]
    command += ["--head-timeout", str(HEAD_TIMEOUT), "--max-connections-per-client", str(CAP)]
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, base, timeout=120)
        yield base
    finally:
        stop(proc)


def _connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _closed_by_server(sock: socket.socket, within: float) -> bool:
    sock.settimeout(within)
    try:
        return sock.recv(4096) == b""
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


def test_a_trickling_request_head_is_closed_after_the_head_timeout(url: str) -> None:
    socks = [_connect(url) for _ in range(4)]
    try:
        started = time.monotonic()
        for sock in socks:  # a line, then headers one byte at a time, never the blank line
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        deadline = started + HEAD_TIMEOUT * 0.8
        while time.monotonic() < deadline:  # bytes keep coming: they do not extend the timeout
            for sock in socks:
                sock.sendall(b"a")
            time.sleep(0.1)
        assert all(_closed_by_server(sock, within=HEAD_TIMEOUT * 5) for sock in socks)
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200  # everyone else is served
    finally:
        for sock in socks:
            sock.close()


def test_connections_beyond_the_cap_from_one_address_are_refused(url: str) -> None:
    socks = [_connect(url) for _ in range(CAP)]
    try:
        extra = _connect(url)
        extra.settimeout(10)
        answer = extra.recv(4096)
        assert answer.startswith(b"HTTP/1.1 503") and b"too many connections" in answer
        extra.close()
    finally:
        for sock in socks:
            sock.close()
    # Once they close, the address may connect again.
    deadline = time.monotonic() + 10
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=10).status_code == 200:
                break
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "the address stayed refused after its connections closed"
        time.sleep(0.1)


def test_a_kept_alive_client_is_served_within_the_cap(url: str) -> None:
    with httpx.Client(base_url=url, timeout=10) as client:  # one connection, many requests
        assert all(client.get("/health").status_code == 200 for _ in range(3 * CAP))
