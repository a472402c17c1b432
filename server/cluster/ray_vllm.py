"""A Ray actor serving vLLM as one of the manager's engines (`RayEngines(vllm_python=...)`).

The actor starts vLLM's OpenAI server (``python -m vllm.entrypoints.openai.api_server``, with the interpreter
of a virtualenv that has vLLM, on the actor's node) and adds it to the manager as an OpenAI backend
(``POST /v1/backends`` with the cluster token, `server.cluster.openai_backend`). vLLM dies with the actor
(Linux: the parent-death signal). When Ray restarts the actor, the new one starts vLLM again and adds it
again: the manager took the old one out of service when it stopped answering, and runs its work elsewhere.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Sequence

import httpx

from server.cluster.ray_nodes import free_port, node_ip

__all__ = ["VLLMActor"]

_PR_SET_PDEATHSIG = 1


class VLLMActor:
    """The body of one vLLM actor (wrapped by `ray.remote` in `server.cluster.ray_engines`)."""

    def __init__(
        self,
        python: str,
        model: str,
        manager_url: str,
        cluster_token: str,
        args: Sequence[str],
        env: dict[str, str],
        tokenizer: str | None,
        timeout_s: float,
    ) -> None:
        host = node_ip()
        port = free_port(host)
        self.url = f"http://{host}:{port}"
        command = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model]
        command += ["--host", host, "--port", str(port), *args]
        # Our PYTHONPATH would shadow packages of vLLM's virtualenv (this repository's `kernels`).
        child_env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
        self.log_path = os.path.join(tempfile.gettempdir(), f"parrot-vllm-{port}.log")
        libc = ctypes.CDLL("libc.so.6", use_errno=True)  # loaded here: the child only calls it

        def die_with_parent() -> None:  # in the child, before exec: SIGTERM once the actor's process dies
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)

        with open(self.log_path, "w") as log:
            self._proc = subprocess.Popen(
                command,
                env={**child_env, **env},
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=die_with_parent,
            )
        self._wait_until_up(timeout_s)
        body = {"url": self.url, **({"tokenizer": tokenizer} if tokenizer else {})}
        auth = {"Authorization": f"Bearer {cluster_token}"}
        r = httpx.post(f"{manager_url}/v1/backends", json=body, headers=auth, timeout=timeout_s)
        if not r.is_success:
            self._proc.terminate()
            raise RuntimeError(f"the manager refused vLLM at {self.url}: HTTP {r.status_code} {r.text[:300]}")
        self.engine_id = int(r.json()["engine_id"])

    def _wait_until_up(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            if self._proc.poll() is not None:
                raise RuntimeError(f"vLLM exited ({self._proc.returncode}); its log: {self.log_path}")
            try:
                if httpx.get(f"{self.url}/v1/models", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                self._proc.terminate()
                raise RuntimeError(f"vLLM did not start within {timeout_s:g}s; its log: {self.log_path}")
            time.sleep(1)

    def engine_url(self) -> str:
        return self.url

    def pid(self) -> int:
        return os.getpid()
