"""Runs that look inside a real engine: an idle engine and an empty KV cache before, the step trace and the
KV high-water mark after (in-process servers of `systems.serve`).

`measure.timed` counts an engine's work; some figures need its steps one by one (the time between two
output tokens, `tpot`). `from_empty_cache` runs a job from a cache with nothing kept from earlier runs
(the manager's cached prefixes dropped, so a shared prompt is prefilled inside the timed run), the engine
tracing its steps (``EngineConfig(trace_steps=...)``), its KV peak taken by `peaks.peaked`, and returns
a `Traced` run; `compare` is `measure.agree` + `measure.interleave` over such runs. `idle` waits for an
engine with nothing running; `model_facts` sizes an engine before it starts.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from benchmarks.common import Spread, safe_ratio
from benchmarks.harness import measure
from benchmarks.harness.measure import Job, Run, Samples
from benchmarks.harness.peaks import peaked
from benchmarks.harness.systems import Served
from server.engine.step_features import StepRecord

__all__ = [
    "Traced",
    "as_dict",
    "compare",
    "drop_cached_contexts",
    "from_empty_cache",
    "idle",
    "model_facts",
    "tpot",
    "traced",
]


def model_facts(model: str) -> tuple[Any, int]:
    """``model``'s tokenizer and context window without loading its weights (``"tiny"`` or a local Hugging
    Face folder): what sizing a KV cache for a workload needs before the engine starts."""
    from transformers import AutoTokenizer

    from server.engine.config import ModelConfig

    if model == "tiny":
        from server.engine.tiny import TOKENIZER_DIR
        from server.engine.tiny.model import TINY_CONFIG

        folder, config = Path(TOKENIZER_DIR), ModelConfig.from_hf_dict(TINY_CONFIG)
    else:
        folder, config = Path(model), ModelConfig.from_pretrained(Path(model))
    return AutoTokenizer.from_pretrained(str(folder), local_files_only=True), config.max_position_embeddings


def tpot(trace: Sequence[StepRecord], pure: bool = False) -> float:
    """Per-output-token latency: the decode-weighted mean step time ``sum(decodes_i * seconds_i) /
    sum(decodes_i)`` (a request waits one step per output token after its first); ``pure``: over the
    steps that prefill nothing (the decode path alone). NaN without decodes."""
    steps = [r for r in trace if r.features.decode_seqs and not (pure and r.features.prefill_tokens)]
    tokens = sum(r.features.decode_seqs for r in steps)
    return safe_ratio(sum(r.features.decode_seqs * r.seconds for r in steps), tokens)


@dataclass(frozen=True)
class Traced(Run):
    """A timed run with the engines' steps and the most KV blocks in use at once (per engine, summed)."""

    trace: tuple[StepRecord, ...] = ()
    blocks_peak: int = 0
    grouped_decode_steps: int = 0  # decode steps that read a shared prefix once for its group

    @property
    def tpot(self) -> float:
        return tpot(self.trace)

    @property
    def tpot_pure(self) -> float:
        return tpot(self.trace, pure=True)

    @property
    def decode_steps(self) -> int:
        return sum(1 for r in self.trace if r.features.decode_seqs)


def traced(samples: Samples) -> list[Traced]:
    """The runs of ``samples``, which `from_empty_cache` made."""
    runs = [r for r in samples.runs if isinstance(r, Traced)]
    if len(runs) != len(samples.runs):
        raise TypeError("these samples hold runs not made by `from_empty_cache`")
    return runs


def as_dict(samples: Samples) -> dict[str, Any]:
    """`Samples.as_dict` with the figures of the runs' traces: TPOT and pure-decode TPOT (spreads), the KV
    peak of every run and the largest, decode steps and grouped decode steps per run."""
    runs = traced(samples)
    return samples.as_dict() | {
        "tpot": Spread.of(r.tpot for r in runs).as_dict(),
        "tpot_pure": Spread.of(r.tpot_pure for r in runs).as_dict(),
        "peak_blocks": [r.blocks_peak for r in runs],
        "peak_blocks_max": max((r.blocks_peak for r in runs), default=0),
        "decode_steps": [r.decode_steps for r in runs],
        "grouped_decode_steps": [r.grouped_decode_steps for r in runs],
    }


async def idle(served: Served, *, empty: bool = False, timeout: float = 10.0) -> None:
    """Wait until no engine of ``served`` runs or queues a request (``empty``: and holds no KV block —
    a context is freed just after its answer is sent)."""
    deadline = time.monotonic() + timeout
    while any(
        s.running or s.waiting or (empty and s.blocks_used) for s in (e.stats() for e in served.engines)
    ):
        if time.monotonic() > deadline:
            raise RuntimeError(f"{served.system.name}: the engines are still busy after {timeout} s")
        await asyncio.sleep(0.005)


async def drop_cached_contexts(served: Served) -> int:
    """Free every context the manager keeps for reuse (shared prefixes, finished steps): the next run
    starts from an empty KV cache. Between runs only. Returns how many were dropped."""
    if served.server is None:
        raise ValueError(f"{served.system.name}: only an in-process server's manager can be reached")
    server = served.server
    return await asyncio.to_thread(server.run, server.manager.drop_cache())


async def from_empty_cache(served: Served, job: Job) -> Traced:
    """`measure.timed` of ``job`` from an empty KV cache, with its step trace and KV peak; the cached
    contexts it leaves are dropped afterwards too."""
    await drop_cached_contexts(served)
    await idle(served, empty=True)
    engines = list(served.engines)
    for e in engines:
        if e.step_trace is None:
            raise ValueError(f"{served.system.name}: start its engine with EngineConfig(trace_steps=...)")
        e.step_trace.clear()
    grouped = sum(e.stats().grouped_decode_steps for e in engines)
    run, peak = await peaked(served, job)
    await idle(served)
    trace = tuple(r for e in engines for r in e.step_trace)
    grouped = sum(e.stats().grouped_decode_steps for e in engines) - grouped
    await drop_cached_contexts(served)
    return Traced(
        **{f.name: getattr(run, f.name) for f in fields(Run)},
        trace=trace,
        blocks_peak=peak,
        grouped_decode_steps=grouped,
    )


async def compare(
    servers: Mapping[str, Served], job: Callable[[Served], Job], repeats: int, label: str = ""
) -> dict[str, Samples]:
    """`measure.agree` (the warm-up) then `measure.interleave` of each server's ``job``, every run from an
    empty KV cache (`from_empty_cache`)."""
    jobs = {name: functools.partial(from_empty_cache, s, job(s)) for name, s in servers.items()}
    return await measure.interleave(jobs, repeats, await measure.agree(jobs), label)
