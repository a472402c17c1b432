"""The load tool's server side (`benchmarks.load`): the server under test in a subprocess of its own, the
remote engine that fault mode kills, and the thread that kills it.

The server under test runs apart from the load, so its RSS is its own: ``python -m benchmarks.load
--host-server PORT`` (`host_server`) starts the manager and tiny engines through `server.launch` and answers
"drop your prefix cache" on its stdin (there is no HTTP route for that; it is what makes the leak count
exact). `RemoteEngine` is a ``python -m server.engine --manager URL`` process that joins it; `engine_killer`
SIGKILLs and restarts it every few seconds while a load runs.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import IO, Any

from benchmarks.harness.output import log
from server.common.malloc_tuning import OBJECTS_ON_MALLOC, PYTHON_ALLOCATOR_ENV

CLUSTER_TOKEN_ENV = "PARROT_CLUSTER_TOKEN"  # what `python -m server` and `python -m server.engine` read
HEARTBEAT_S = 0.5  # the hosted manager's heartbeat check, so a dead remote engine leaves service quickly
START_TIMEOUT_S = 180.0  # importing torch and building engines on a busy 2-core machine


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class HostedServer:
    """The server under test, in a subprocess (``python -m benchmarks.load --host-server``), with ``engines``
    local tiny engines (in fault mode, one fewer than the load's: the remote engine is the other)."""

    def __init__(self, engines: int, token: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # Run as `python -m server` runs (server.common.malloc_tuning): Python's objects on glibc's heap.
        env = {**os.environ, CLUSTER_TOKEN_ENV: token}
        env.setdefault(PYTHON_ALLOCATOR_ENV, OBJECTS_ON_MALLOC)
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "benchmarks.load",
                "--host-server",
                str(self.port),
                "--engines",
                str(engines),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            text=True,
        )
        self.pid = self.proc.pid
        ready = self._read()
        if not ready.get("ready"):
            self.close()
            raise RuntimeError(f"the server did not start: {ready}")

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the server process exited (status {self.proc.wait()})")
        return json.loads(line)

    def drop_cache(self) -> int:
        """Have the manager free every cached context (prefixes, finished steps); returns how many."""
        assert self.proc.stdin is not None
        self.proc.stdin.write("drop_cache\n")
        self.proc.stdin.flush()
        return int(self._read()["dropped"])

    def close(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL after a minute) and close its pipes."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                pipe.close()


def host_server(port: int, engines: int) -> None:
    """The host process: `server.launch` the manager and tiny engines, then serve stdin commands."""
    from server.engine import EngineConfig
    from server.launcher import launch
    from server.serve.manager import ManagerConfig

    config = ManagerConfig(heartbeat_interval=HEARTBEAT_S, engine_timeout=4 * HEARTBEAT_S)
    token = os.environ[CLUSTER_TOKEN_ENV]
    out: IO[str] = sys.stdout
    with launch(
        "tiny",
        engines=engines,
        port=port,
        engine_config=EngineConfig(num_kv_blocks=2048),
        manager_config=config,
        cluster_token=token,
        startup_timeout=START_TIMEOUT_S,
    ) as served:
        out.write(json.dumps({"ready": True, "url": served.url}) + "\n")
        out.flush()
        for line in sys.stdin:
            if line.strip() == "drop_cache":
                dropped = served.run(served.manager.drop_cache())
                out.write(json.dumps({"dropped": dropped}) + "\n")
                out.flush()


class RemoteEngine:
    """A remote engine process joined to the manager; `restart` kills it (SIGKILL) and starts a new one."""

    def __init__(self, manager_url: str, token: str) -> None:
        self.manager_url, self.token = manager_url, token
        self.kills = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    def start(self) -> None:
        """Start a new engine process on a free port; it joins the manager on its own."""
        port = free_port()
        self.proc = subprocess.Popen(
            [
                *(sys.executable, "-m", "server.engine", "--model", "tiny", "--port", str(port)),
                *("--manager", self.manager_url, "--name", f"load-remote-{port}", "--num-kv-blocks", "2048"),
            ],
            env={**os.environ, CLUSTER_TOKEN_ENV: self.token},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    def restart(self) -> None:
        """Kill the engine (counted in `kills`) and start a new one."""
        self.stop()
        self.kills += 1
        self.start()

    def stop(self) -> None:
        """SIGKILL the engine if it runs."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@contextlib.contextmanager
def engine_killer(remote: RemoteEngine | None, every_s: float | None) -> Iterator[None]:
    """While the body runs, SIGKILL and restart ``remote`` every ``every_s`` seconds."""
    if remote is None or not every_s:
        yield
        return
    stop = threading.Event()

    def loop() -> None:
        while not stop.wait(every_s):
            log(f"killing the remote engine (kill {remote.kills + 1})")
            remote.restart()

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
