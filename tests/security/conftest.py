"""Shared setup of the security tests: serving an ASGI app (an engine, or an impostor) on a real port."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn
from starlette.types import ASGIApp

TOKEN = "cluster-token-under-test"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@contextmanager
def serving(app: ASGIApp) -> Iterator[str]:
    """``app`` on 127.0.0.1 in a background thread; yields its base URL."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "the test server did not start"
            time.sleep(0.01)
        yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
