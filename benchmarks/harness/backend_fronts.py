"""Parrot in front of OpenAI-compatible backends (`server.cluster.openai_backend`), as
`benchmarks.vllm_backends` runs it: the backends started on a model's weights (`backends`: vLLM servers,
or Parrot's own ``/v1`` where no vLLM is given), a Parrot manager with no engine of its own over them
(`front`), and the client network delay both clients add to each of their requests (`Delay`).

The delay sits in the clients' HTTP transports, not in a server: the baseline talks to vLLM directly, and
vLLM has no delay of its own to switch on.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx

from benchmarks.harness.hf_generate import hf_folder
from benchmarks.harness.openai_servers import Backend, parrot_backend, vllm_backends
from benchmarks.harness.systems import DELAY_S
from benchmarks.harness.vllm_settings import vllm_env
from server.cluster.openai_backend import OpenAIBackendConfig
from server.engine import EngineConfig, LLMEngine
from server.launcher import launch
from server.serve.manager import ManagerConfig

__all__ = ["Delay", "backends", "front"]


class Delay:
    """The client network delay, per request, switched on and off (both clients' transports)."""

    def __init__(self, seed: int) -> None:
        self.on = False
        self._rng = random.Random(seed)

    async def __call__(self, request: httpx.Request) -> None:
        if self.on:
            await asyncio.sleep(self._rng.uniform(*DELAY_S))


@contextlib.contextmanager
def backends(
    model: str,
    vllm_python: str | None,
    count: int,
    workdir: Path,
    max_model_len: int,
    max_num_seqs: int = 32,
) -> Iterator[list[Backend]]:
    """``count`` vLLM servers on ``model``'s weights (float32, so batching does not change greedy picks),
    or Parrot servers without ``vllm_python``; their logs (vLLM's) in ``workdir``."""
    with contextlib.ExitStack() as stack:
        if not vllm_python:
            config = EngineConfig(dtype="float32", num_kv_blocks=512, max_model_len=max_model_len)
            yield [stack.enter_context(parrot_backend(model, engine_config=config)) for _ in range(count)]
            return
        # Our engine only to find (or write) a Hugging Face folder of the weights and size vLLM's KV cache.
        engine = LLMEngine.from_pretrained(model, EngineConfig(dtype="float32", num_kv_blocks=16))
        folder = hf_folder(model, engine, workdir, EngineConfig().seed)
        env = vllm_env(engine.model_config, "float32", max_model_len, max_num_seqs)
        engine.shutdown()
        logs = [workdir / f"vllm{i}.log" for i in range(count)]
        yield stack.enter_context(
            vllm_backends(
                vllm_python,
                folder,
                logs,
                dtype="float32",
                max_model_len=max_model_len,
                max_num_seqs=max_num_seqs,
                env=env,
            )
        )


def front(
    model: str, urls: Sequence[str], max_model_len: int, affinity: bool = True
) -> contextlib.AbstractContextManager[Any]:
    """A Parrot manager whose engines are the backends at ``urls`` (the served model's tokenizer), its
    prefix affinity on or off. A `LaunchedServer`, typed Any: its engines are `OpenAIBackendEngine`s (with
    their request counts), not the `LLMEngine`s it declares."""
    config = [OpenAIBackendConfig(u, tokenizer=model, max_model_len=max_model_len) for u in urls]
    return launch(
        model, engines=0, openai_backends=config, manager_config=ManagerConfig(prefix_affinity=affinity)
    )
