"""Runs that look inside a real engine: an idle engine and an empty KV cache before, the step trace and the
KV high-water mark after (in-process servers of `systems.serve`).

`measure.timed` counts an engine's work; some figures need its steps one by one (the time between two
output tokens, `tpot`). `from_empty_cache` runs a job from a cache with nothing kept from earlier runs
(the manager's cached prefixes dropped, so a shared prompt is prefilled inside the timed run), the engine
tracing its steps (``EngineConfig(trace_steps=...)``), its KV peak taken by `peaks.peaked`, and returns
a `Traced` run; `compare` is `measure.agree` + `measure.interleave` over such runs, and `sweep` is
`compare` at every point of a sweep (a batch size, say). `idle` waits for an engine with nothing running;
`model_facts` sizes an engine before it starts. For the report: `expected_peaks` is the KV peak the paged
design predicts (`kv_blocks`), `figure_ratio` divides two systems' figures (`as_dict`), and `trace_table`
shows those figures beside `record.latency_table`.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

from benchmarks.harness import measure, systems
from benchmarks.harness.measure import Job, Run, Samples
from benchmarks.harness.output import fmt_num, log, markdown_table
from benchmarks.harness.peaks import peaked
from benchmarks.harness.stats import Spread, safe_ratio
from benchmarks.harness.systems import Served
from server.engine.step_features import StepRecord

__all__ = [
    "Traced",
    "as_dict",
    "compare",
    "expected_peaks",
    "figure_ratio",
    "from_empty_cache",
    "idle",
    "kv_blocks",
    "model_facts",
    "sweep",
    "tpot",
    "trace_table",
    "traced",
]


def model_facts(model: str) -> tuple[Any, int]:
    """``model``'s tokenizer and context window without loading its weights (any name the engine takes:
    ``"tiny"``, ``"smollm2"``, a GGUF file, a Hugging Face folder): what sizing a KV cache for a workload
    needs before the engine starts."""
    from server.engine.loader import load_model_config, load_tokenizer

    return load_tokenizer(model), load_model_config(model).max_position_embeddings


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


async def from_empty_cache(served: Served, job: Job) -> Traced:
    """`measure.timed` of ``job`` from an empty KV cache, with its step trace and KV peak; the cached
    contexts it leaves are dropped afterwards too."""
    if served.server is None:
        raise ValueError(f"{served.system.name}: only an in-process server's manager can be reached")
    await served.drop_kept_contexts()
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
    await served.drop_kept_contexts()
    return Traced(
        **{f.name: getattr(run, f.name) for f in fields(Run)},
        trace=trace,
        blocks_peak=peak,
        grouped_decode_steps=grouped,
    )


async def compare(
    servers: Mapping[str, Served],
    job: Callable[[Served], Job],
    repeats: int,
    label: str = "",
    warm_up: bool = True,
) -> dict[str, Samples]:
    """`measure.agree` (the warm-up; skipped without ``warm_up``: the repeats' outputs are then checked
    against each other) then `measure.interleave` of each server's ``job``, every run from an empty KV
    cache (`from_empty_cache`)."""
    jobs = {name: functools.partial(from_empty_cache, s, job(s)) for name, s in servers.items()}
    expected = await measure.agree(jobs) if warm_up else measure.FIRST_RUN
    return await measure.interleave(jobs, repeats, expected, label)


async def sweep(
    servers: Mapping[str, Served],
    points: Mapping[str, Callable[[Served], Job]],
    repeats: int,
    timeout: float = 600.0,
) -> dict[str, dict[str, Samples]]:
    """`compare` at every point of a sweep (``points``: its label, e.g. ``"b8"``, and each server's job
    there), in order, the servers connected once for all (`systems.connected`). Only the first point warms
    up: the servers are warm after it, and a later point's repeats check its answers (the median of its
    repeats absorbs a first run at a new size; a warm-up there cost as much as a repeat)."""
    out = {}
    async with systems.connected(servers, timeout=timeout):
        for i, (label, job) in enumerate(points.items()):
            log(f"{label}: verifying answers and warming up ..." if i == 0 else f"{label}:")
            out[label] = await compare(servers, job, repeats, f"{label} ", warm_up=i == 0)
    return out


def kv_blocks(contexts: Sequence[int], block_size: int, shared_prefix: int = 0) -> int:
    """KV blocks of ``contexts`` (tokens with KV, each) all alive at once. With a ``shared_prefix``
    (tokens), every context is a fork of it: the prefix's blocks once, and per fork its tokens beyond the
    prefix's full blocks (a fork owns its copy of the prefix's partial last block). Without one, every
    whole context."""
    blocks = lambda n: -(-n // block_size)  # noqa: E731
    return blocks(shared_prefix) + sum(blocks(c) - shared_prefix // block_size for c in contexts)


def expected_peaks(
    prompts: Sequence[Sequence[int]], shared_prefix: int, new_tokens: int, block_size: int
) -> tuple[int, int]:
    """The KV peak the paged design predicts for ``prompts`` (token ids) answered with ``new_tokens`` each,
    every context alive at its end (KV for its prompt and all but its last token): forked from their
    ``shared_prefix`` (exact), and each whole (a bound: early requests may finish before late ones start)."""
    contexts = [len(p) + new_tokens - 1 for p in prompts]
    return kv_blocks(contexts, block_size, shared_prefix), kv_blocks(contexts, block_size)


def figure_ratio(figures: Mapping[str, Mapping[str, Any]], slow: str, fast: str, key: str) -> float:
    """System ``slow``'s figure ``key`` over system ``fast``'s, in `as_dict` form (``figures`` by system):
    the medians of a spread (latency, TPOT), or plain numbers (the KV peak)."""
    x, y = figures[slow][key], figures[fast][key]
    return safe_ratio(x["median"], y["median"]) if isinstance(x, Mapping) else safe_ratio(x, y)


def trace_table(
    settings: Sequence[tuple[str, Mapping[str, Mapping[str, Any]], Mapping[str, float]]],
    setting_header: str,
    reference: str,
) -> str:
    """Per setting and system: TPOT (decode-weighted, and pure-decode), the KV peak (the ``expected_blocks``
    entry, if any, beside it), the last run's grouped decode steps out of its decode steps, and the system's
    TPOT over ``reference``'s; ``settings`` holds each system's `as_dict` figures and those ratios."""
    rows = []
    for setting, per_system, ratios in settings:
        for name, f in per_system.items():
            tp = Spread(*(f["tpot"][k] for k in ("median", "min", "max", "n")))
            peak = fmt_num(f["peak_blocks_max"])
            rows.append(
                [
                    setting,
                    name,
                    f"{tp.median * 1e3:.2f} ±{tp.rel_half_range:.0%}",
                    f"{f['tpot_pure']['median'] * 1e3:.2f}",
                    f"{peak} ({fmt_num(f['expected_blocks'])})" if "expected_blocks" in f else peak,
                    f"{f['grouped_decode_steps'][-1]}/{f['decode_steps'][-1]}",
                    f"{ratios[name]:.2f}x" if name in ratios else "",
                ]
            )
    expected = any("expected_blocks" in f for _, per_system, _ in settings for f in per_system.values())
    heads = [setting_header, "system", "TPOT ms", "pure-decode TPOT ms"]
    heads += ["peak KV blocks (expected)" if expected else "peak KV blocks", "grouped / decode steps (last)"]
    heads += [f"TPOT this / {reference}"]
    return markdown_table(heads, rows, [True, False, *([True] * 5)])
