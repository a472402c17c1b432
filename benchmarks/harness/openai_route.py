"""The OpenAI route as a system of an engine-level comparison: what a third-party client gets.

`OpenAIRoute` drives a server's ``POST /v1/completions`` the way `OurEngine` drives the engine API: every
prompt (as token ids) in its own request, all at once, greedy, exactly N new tokens (``ignore_eos``); its
time runs from the first request sent to the last answer read, over one HTTP/1.1 connection per request.
The server's prefix cache is emptied before every run (`Backend.reset_prefix_cache`, untimed), so each
run prefills its prompts as the engine-API run does. A route answers text, not token ids: its tokens are
the answer re-tokenized, so the "same tokens" check can differ from the ids it generated at a token
boundary.

`openai_routes` starts the servers: Parrot's own (`server.launch`, one in-process engine with the engine
config of the comparison) and, with ``--vllm-python``, vLLM's ``api_server`` on the same weights (prefix
caching off there too, as in `benchmarks/vllm_worker.py`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx

from benchmarks.harness.generators import Outputs
from benchmarks.harness.openai_servers import Backend, parrot_backend, vllm_backend
from benchmarks.harness.output import log
from benchmarks.harness.vllm_generate import vllm_dtype
from benchmarks.harness.vllm_settings import vllm_env
from server.engine import EngineConfig, LLMEngine

__all__ = ["OpenAIRoute", "openai_routes"]


class OpenAIRoute:
    """A server's ``/v1/completions`` as a `benchmarks.harness.generators.Generator`."""

    def __init__(self, name: str, backend: Backend, tokenizer: Any, settle_s: float = 0.0) -> None:
        self.name = name
        self.backend = backend
        self.tokenizer = tokenizer
        self.settle_s = settle_s  # how long the server keeps the cores busy after it answers
        models = httpx.get(f"{backend.url}/v1/models", timeout=30).raise_for_status().json()
        self.model = str(models["data"][0]["id"])

    def run(self, prompts: Sequence[list[int]], max_new_tokens: int) -> tuple[float, Outputs]:
        self.backend.reset_prefix_cache()
        return asyncio.run(self._run(prompts, max_new_tokens))

    async def _run(self, prompts: Sequence[list[int]], max_new_tokens: int) -> tuple[float, Outputs]:
        limits = httpx.Limits(max_connections=len(prompts), max_keepalive_connections=len(prompts))
        async with httpx.AsyncClient(base_url=self.backend.url, timeout=3600, limits=limits) as client:

            async def one(prompt: list[int]) -> str:
                body = {
                    "model": self.model,
                    "prompt": prompt,
                    "max_tokens": max_new_tokens,
                    "temperature": 0.0,
                    "ignore_eos": True,
                }
                reply = (await client.post("/v1/completions", json=body)).raise_for_status()
                return str(reply.json()["choices"][0]["text"])

            start = time.perf_counter()
            texts = await asyncio.gather(*(one(p) for p in prompts))
            elapsed = time.perf_counter() - start
        return elapsed, [self.tokenizer.encode(t, add_special_tokens=False) for t in texts]


@contextlib.contextmanager
def openai_routes(
    args: argparse.Namespace,
    engine: LLMEngine,
    config: EngineConfig,
    folder: Path,
    max_model_len: int,
    max_num_seqs: int,
    workdir: Path,
) -> Iterator[list[OpenAIRoute]]:
    """Parrot's ``/v1`` on ``args.model`` with ``config``, and vLLM's (`vllm_generate.vllm_dtype`) on
    ``folder`` where ``--vllm-python`` is given; none with ``--no-openai``; stopped on exit."""
    with contextlib.ExitStack() as stack:
        if not args.openai:
            yield []
            return
        log(f"starting Parrot's server on {args.model} for its OpenAI route ...")
        ours = stack.enter_context(parrot_backend(args.model, engine_config=config, startup_timeout=600))
        routes = [OpenAIRoute("ours_v1", ours, engine.tokenizer)]
        if args.vllm_python:
            dtype = vllm_dtype(args)
            log(f"starting vLLM's api_server ({dtype}) for its OpenAI route ...")
            env = vllm_env(engine.model_config, dtype, max_model_len, max_num_seqs, args.vllm_env)
            theirs = stack.enter_context(
                vllm_backend(
                    args.vllm_python,
                    folder,
                    dtype=dtype,
                    max_model_len=max_model_len,
                    max_num_seqs=max_num_seqs,
                    env=env,
                    log_path=workdir / "vllm-api-server.log",
                    extra=["--no-enable-prefix-caching"],
                )
            )
            # vLLM's readers poll for a second after an answer (`vllm_generate.VLLMWorker.settle_s`).
            routes.append(OpenAIRoute("vllm_v1", theirs, engine.tokenizer, settle_s=1.2))
        yield routes
