"""The systems of an engine-level comparison, and our engine as one of them.

Every system is a `Generator`: ``run(prompts, n)`` generates exactly ``n`` tokens greedily for every prompt
of the batch at once and returns (seconds, token ids), with no server in between. `OurEngine` drives our
engine; Hugging Face ``generate`` is `benchmarks.harness.hf_generate.HFGenerate` and vLLM (in a worker
process of its own interpreter) `benchmarks.harness.vllm_generate.VLLMWorker`. `model_record` says what
weights they ran, for a results file.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any, Protocol

import torch

from benchmarks.harness.engine_models import engine_model
from server.engine import LLMEngine, SamplingParams
from server.engine.model_names import resolve_model

__all__ = ["DTYPES", "Generator", "OurEngine", "Outputs", "dtype_name", "model_record"]

DTYPES = ("float32", "float16", "bfloat16")
Outputs = list[list[int]]


class Generator(Protocol):
    """A way to run a batch of greedy generations; every system of a comparison is driven through it."""

    name: str

    def run(self, prompts: Sequence[list[int]], max_new_tokens: int) -> tuple[float, Outputs]:
        """Generate ``max_new_tokens`` greedily for every prompt at once; return (seconds, token ids)."""
        ...


class OurEngine:
    """Our engine, driven as the manager drives it: per request a fill then a generate, all concurrent."""

    name = "ours"

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        # One event loop for the whole run: results come back into it from the engine thread.
        self._loop = asyncio.new_event_loop()
        self._ids = itertools.count(1)

    def run(self, prompts: Sequence[list[int]], max_new_tokens: int) -> tuple[float, Outputs]:
        return self.call(self._run(prompts, max_new_tokens))

    async def _run(self, prompts: Sequence[list[int]], max_new_tokens: int) -> tuple[float, Outputs]:
        sampling = SamplingParams(max_tokens=max_new_tokens, ignore_eos=True)
        ids = self.context_ids(len(prompts))

        async def one(cid: int, prompt: list[int]) -> list[int]:
            await self.engine.fill(cid, prompt)
            return (await self.engine.generate(cid, sampling)).token_ids

        start = time.perf_counter()
        outputs = await asyncio.gather(*(one(c, p) for c, p in zip(ids, prompts, strict=True)))
        elapsed = time.perf_counter() - start
        # Freed outside the timed region: a server frees contexts after answering.
        await asyncio.gather(*(self.engine.free_context(c) for c in ids))
        return elapsed, list(outputs)

    def context_ids(self, n: int) -> list[int]:
        """``n`` context ids never used before in this run (the engine rejects a live id)."""
        return [next(self._ids) for _ in range(n)]

    def call(self, coro: Any) -> Any:
        """Run a coroutine that talks to the engine on this runner's event loop."""
        return self._loop.run_until_complete(coro)

    def close(self) -> None:
        self._loop.close()


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def model_record(model: str, engine: LLMEngine) -> dict[str, Any]:
    """What ran, for a results file, without paths of this machine: the name as given (a file's stem for a
    path), the weights file's name and size (a folder's: its files'), the config and parameter count."""
    path = resolve_model(model).path
    files = [] if path is None else [path] if path.is_file() else [f for f in path.iterdir() if f.is_file()]
    return {
        "name": resolve_model(model).name,
        "file": None if path is None else path.name,
        "file_bytes": None if path is None else sum(f.stat().st_size for f in files),
        "config": asdict(engine.model_config),
        "parameters": sum(p.numel() for p in engine_model(engine).parameters()),
    }
