"""OpenAI-compatible servers that Parrot uses as engines: a real vLLM (its ``api_server`` in its own
virtualenv) or Parrot's own ``/v1``, with what experiments read from them — prompt tokens computed (so a
prefix-cache hit rate) — and a way to empty their prefix cache between timed runs."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from benchmarks.harness.process_groups import wait_until_answers
from server.cluster.ray_nodes import free_port
from server.launcher import LaunchedServer, launch

__all__ = ["Backend", "parrot_backend", "vllm_backend", "vllm_backends"]

STARTUP_S = 300.0


@dataclass
class Backend:
    """A running OpenAI-compatible server: its URL and what it is."""

    url: str
    kind: str  # "vllm" or "parrot"
    server: LaunchedServer | None = None  # Parrot's, in process

    def computed_prompt_tokens(self) -> float:
        """Prompt tokens the server has computed since it started (not served from its prefix cache)."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        if self.kind == "vllm":
            hits = _metric(text, "vllm:prefix_cache_hits_total")
            return _metric(text, "vllm:prefix_cache_queries_total") - hits
        return _metric(text, "parrot_engine_prefill_tokens_computed")

    def reset_prefix_cache(self) -> None:
        """Forget every cached prompt (vLLM in dev mode: ``POST /reset_prefix_cache``)."""
        if self.server is not None:
            self.server.run(self.server.manager.drop_cache())
        else:
            httpx.post(f"{self.url}/reset_prefix_cache", timeout=60).raise_for_status()


def _metric(text: str, name: str) -> float:
    """The sum of a Prometheus metric's samples over its labels."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


@contextlib.contextmanager
def vllm_backend(
    python: str,
    folder: Path,
    *,
    dtype: str,
    max_model_len: int,
    max_num_seqs: int,
    env: dict[str, str],
    log_path: Path,
    extra: Sequence[str] = (),
) -> Iterator[Backend]:
    """``python -m vllm.entrypoints.openai.api_server`` on ``folder`` (its prefix caching on, as vLLM's
    default; dev mode, for ``/reset_prefix_cache``), until it answers ``/v1/models``; stopped on exit."""
    with vllm_backends(
        python,
        folder,
        [log_path],
        dtype=dtype,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        env=env,
        extra=extra,
    ) as (backend,):
        yield backend


@contextlib.contextmanager
def vllm_backends(
    python: str,
    folder: Path,
    log_paths: Sequence[Path],
    *,
    dtype: str,
    max_model_len: int,
    max_num_seqs: int,
    env: dict[str, str],
    extra: Sequence[str] = (),
) -> Iterator[list[Backend]]:
    """One `vllm_backend` per log path, all started at once (a start is mostly single-threaded imports and
    graph tracing, so two overlap on two cores: 60 s for two here, 75 one after the other); all stopped on
    exit, and all if one fails to start."""
    env = {**env, "VLLM_SERVER_DEV_MODE": "1"}
    started: list[tuple[subprocess.Popen[bytes], str, Path]] = []
    with contextlib.ExitStack() as stack:
        for log_path in log_paths:
            port = free_port("127.0.0.1")
            command = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder)]
            command += ["--dtype", dtype, "--port", str(port), "--max-model-len", str(max_model_len)]
            command += ["--max-num-seqs", str(max_num_seqs), *extra]
            log = stack.enter_context(log_path.open("w"))
            proc = subprocess.Popen(
                command, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=log_path.parent
            )
            stack.callback(_stop, proc)
            started.append((proc, f"http://127.0.0.1:{port}", log_path))
        for proc, url, log_path in started:
            wait_until_answers(proc, f"{url}/v1/models", f"vLLM (its log: {log_path})", STARTUP_S, 2.0)
        yield [Backend(url, "vllm") for _, url, _ in started]


def _stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()


@contextlib.contextmanager
def parrot_backend(model: str, **launch_args: object) -> Iterator[Backend]:
    """Parrot's own server (one in-process engine, its OpenAI routes caching prefixes) as the backend."""
    with launch(model, **launch_args) as server:  # type: ignore[arg-type]
        yield Backend(server.url, "parrot", server)
