"""One batch size of an engine-level comparison (`benchmarks.engine_throughput`, `benchmarks.gpu_engine`):
its prompts cut from the stdlib text (`make_prompts`), every system timed on them (`measure_batch`, over
`batch_timing.time_batch`) with checks that the comparison is sound (`BatchResult`), and the tables of
the rows (`throughput_table`, `workload_table`)."""

from __future__ import annotations

import itertools
import operator
import random
from dataclasses import dataclass
from typing import Any, Protocol

from benchmarks.harness.batch_timing import Rates, time_batch
from benchmarks.harness.generators import Generator, OurEngine, Outputs
from benchmarks.harness.measure import Ratio
from benchmarks.harness.output import fmt_num, markdown_table
from workload_text import stdlib_text

__all__ = [
    "KINDS",
    "LABELS",
    "BatchResult",
    "BatchSizes",
    "Sizes",
    "make_prompts",
    "measure_batch",
    "throughput_table",
    "workload",
    "workload_table",
]

LABELS = {"ours": "ours", "hf": "HF", "vllm": "vLLM", "ours_v1": "ours /v1", "vllm_v1": "vLLM /v1"}
KINDS = {"decode": "decode_tps", "prefill": "prefill_tps", "e2e": "e2e_tps"}


class BatchSizes(Protocol):
    """What a batch reads of an experiment's sizes (``engine_throughput.BenchConfig``)."""

    @property
    def prompt_len(self) -> int: ...  # the longest prompt; the others are spread down to spread * it
    @property
    def spread(self) -> float: ...
    @property
    def new_tokens(self) -> int: ...
    @property
    def repeats(self) -> int: ...  # at least (`time_batch`)
    @property
    def min_time_s(self) -> float: ...
    @property
    def seed(self) -> int: ...


@dataclass(frozen=True)
class Sizes:
    """`BatchSizes` as plain values, for an experiment whose own configuration has another shape
    (`benchmarks.gpu_engine`): no time floor on the repeats unless given, the prompts of seed 0."""

    prompt_len: int
    spread: float
    new_tokens: int
    repeats: int
    min_time_s: float = 0.0
    seed: int = 0


def workload(tokenizer: Any, min_tokens: int) -> list[int]:
    """The stdlib text as token ids (no special tokens), at least ``min_tokens`` of them."""
    chars = 4 * min_tokens
    while len(ids := tokenizer(stdlib_text(chars), add_special_tokens=False).input_ids) < min_tokens:
        chars *= 2
    return list(ids)


def make_prompts(tokens: list[int], batch: int, cfg: BatchSizes) -> list[list[int]]:
    """``batch`` prompts cut from the token stream at random offsets, lengths uniform in the spread."""
    rng = random.Random(f"{cfg.seed}-{batch}-{cfg.prompt_len}")  # a string seed: the same on every run
    prompts = []
    for _ in range(batch):
        n = rng.randint(max(1, round(cfg.spread * cfg.prompt_len)), cfg.prompt_len)
        start = rng.randrange(0, len(tokens) - n)
        prompts.append(tokens[start : start + n])
    return prompts


@dataclass
class BatchResult:
    """Every system at one batch size, and checks that the comparison is sound."""

    batch: int
    prompt_tokens: int  # real prompt tokens (what every system is credited with)
    padded_tokens: int  # what HF's left-padded batch computes
    repeats: int
    systems: dict[str, Rates]  # "ours", "hf" and, with --vllm-python, "vllm"
    same_tokens: dict[str, float]  # per other system: share of requests whose tokens equal ours
    outputs: dict[str, Outputs]  # every system's tokens of its last timed run ("ours" included)
    engine_prefill_tokens_per_run: float  # ours computes each prompt token once (no recompute)
    engine_preemptions: int

    def ratio(self, kind: str, other: str) -> Ratio:
        """Ours over ``other`` in ``kind`` tok/s."""
        ours, theirs = self.systems["ours"], self.systems[other]
        return getattr(ours, KINDS[kind]).over(getattr(theirs, KINDS[kind]))


def measure_batch(
    ours: OurEngine, others: list[Generator], prompts: list[list[int]], cfg: BatchSizes
) -> BatchResult:
    before = ours.engine.stats()
    timed = time_batch([ours, *others], prompts, cfg.new_tokens, cfg.repeats, cfg.min_time_s)
    after = ours.engine.stats()
    mine, batch = timed.outputs["ours"], len(prompts)
    theirs = {n: out for n, out in timed.outputs.items() if n != "ours"}
    return BatchResult(
        batch=batch,
        prompt_tokens=sum(len(p) for p in prompts),
        padded_tokens=batch * max(len(p) for p in prompts),
        repeats=timed.repeats,
        systems=timed.rates,
        same_tokens={n: sum(map(operator.eq, mine, out)) / batch for n, out in theirs.items()},
        outputs=timed.outputs,
        # Three runs per repeat: two of T(1), one of T(N).
        engine_prefill_tokens_per_run=(after.prefill_tokens_computed - before.prefill_tokens_computed)
        / (3 * timed.repeats),
        engine_preemptions=after.preemptions - before.preemptions,
    )


def throughput_table(results: list[BatchResult]) -> str:
    """Prefill, decode and end-to-end rates of every system per batch size, with ours over each other."""
    names, others = list(results[0].systems), list(results[0].same_tokens)
    rows = []
    for r, (kind, attr) in itertools.product(results, KINDS.items()):
        rates = [getattr(r.systems[n], attr) for n in names]
        cells = [f"{fmt_num(x.value)} ±{x.rel_half_range:.0%}" for x in rates]
        rows.append([str(r.batch), f"{kind} tok/s", *cells, *(str(r.ratio(kind, n)) for n in others)])
    headers = ["batch", "metric", *(LABELS[n] for n in names), *(f"ours/{LABELS[n]}" for n in others)]
    return markdown_table(headers, rows, [True, False] + [True] * (len(headers) - 2))


def workload_table(results: list[BatchResult], new_tokens: int) -> str:
    """What was run: tokens in and out, the median times, and whether each system made our tokens."""
    names, others = list(results[0].systems), list(results[0].same_tokens)
    headers = ["batch", "prompt tok", "HF padded", "new tok", *(f"{LABELS[n]} T(1) / T(N) s" for n in names)]
    headers += [f"same tokens {LABELS[n]}" for n in others]
    rows = [
        [str(r.batch), fmt_num(r.prompt_tokens), fmt_num(r.padded_tokens), str(new_tokens)]
        + [r.systems[n].times() for n in names]
        + [f"{r.same_tokens[n]:.0%}" for n in others]
        for r in results
    ]
    return markdown_table(headers, rows, [True] * len(headers))
