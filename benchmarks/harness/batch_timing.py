"""One batch on every system of an engine-level comparison, timed alike: ``T(1)`` and ``T(N)`` of each
`Generator`, interleaved repeat after repeat (`time_batch`), and the prefill, decode and end-to-end tok/s
they give (`Rates`), each with the range of the per-repeat figures around it (`Rate`)."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

from benchmarks.harness.generators import Generator, Outputs
from benchmarks.harness.measure import Ratio
from benchmarks.harness.output import log
from benchmarks.harness.stats import Spread, safe_ratio

__all__ = ["Rate", "Rates", "Timed", "time_batch"]


@dataclass(frozen=True)
class Rate:
    """A rate computed from the median times, and the rates of each repeat's own times around it."""

    value: float
    per_repeat: list[float]

    @property
    def spread(self) -> Spread:
        return Spread.of(self.per_repeat)

    @property
    def rel_half_range(self) -> float:
        """Half the per-repeat range relative to the value (``±`` in the tables)."""
        return safe_ratio(self.spread.hi - self.spread.lo, 2 * abs(self.value))

    def over(self, other: Rate) -> Ratio:
        """This rate over ``other``'s: of the values, and the range of the ratios repeat by repeat."""
        pairs = zip(self.per_repeat, other.per_repeat, strict=False)
        per_repeat = Spread.of(safe_ratio(a, b) for a, b in pairs)
        return Ratio(safe_ratio(self.value, other.value), per_repeat.lo, per_repeat.hi)


@dataclass
class Rates:
    """One system at one batch size: ``T(1)`` and ``T(N)`` per repeat (seconds) and the rates from them."""

    t_first: list[float]
    t_full: list[float]
    prefill_tps: Rate  # prompt tokens / T(1)
    decode_tps: Rate  # B (N - 1) / (T(N) - T(1))
    e2e_tps: Rate  # B N / T(N)

    @classmethod
    def of(
        cls, t_first: list[float], t_full: list[float], prompt_tokens: int, batch: int, new_tokens: int
    ) -> Rates:
        """Rates from the medians of the times (robust to one slow repeat); ranges from each repeat alone."""
        t1, tn = Spread.of(t_first).median, Spread.of(t_full).median
        decode = batch * (new_tokens - 1)
        pairs = zip(t_first, t_full, strict=True)
        return cls(
            t_first,
            t_full,
            Rate(safe_ratio(prompt_tokens, t1), [safe_ratio(prompt_tokens, t) for t in t_first]),
            Rate(  # no rate where the noise swallowed the decode (T(N) <= T(1)), never a negative one
                safe_ratio(decode, tn - t1) if tn > t1 else math.nan,
                [safe_ratio(decode, b - a) if b > a else math.nan for a, b in pairs],
            ),
            Rate(safe_ratio(batch * new_tokens, tn), [safe_ratio(batch * new_tokens, t) for t in t_full]),
        )

    def times(self) -> str:
        """The median ``T(1) / T(N)`` in seconds (for a table cell)."""
        return f"{Spread.of(self.t_first).median:.3f} / {Spread.of(self.t_full).median:.3f}"


@dataclass
class Timed:
    """Every system's rates at one batch, the outputs of its last run, the repeats done."""

    rates: dict[str, Rates]
    outputs: dict[str, Outputs]
    repeats: int


def _settle_s(system: Generator) -> float:
    """How long ``system`` keeps the cores busy after it answers (``settle_s``, e.g. vLLM's polling readers;
    0 for systems that go quiet at once)."""
    return float(getattr(system, "settle_s", 0.0))


def time_batch(
    systems: Sequence[Generator],
    prompts: Sequence[list[int]],
    new_tokens: int,
    repeats: int,
    min_time_s: float,
) -> Timed:
    """A warm-up run of every system, then ``T(1)`` and ``T(N)`` of each, interleaved, repeat after repeat.

    At least ``repeats`` repeats, more (up to 3x) while less than ``min_time_s`` was spent: small batches
    are cheap and the noisiest relative to their length, so they get more samples.
    """
    times: dict[str, tuple[list[float], list[float]]] = {s.name: ([], []) for s in systems}
    outputs: dict[str, Outputs] = {}
    for system in systems:  # warm-up: one-time allocations, workspaces, lazy imports, compiled shapes
        system.run(prompts, new_tokens)
        time.sleep(_settle_s(system))
    started, rep = time.perf_counter(), 0
    while rep < repeats or (rep < 3 * repeats and time.perf_counter() - started < min_time_s):
        # In order, then reversed: a slow drift of the machine hits every system alike, and each pair of
        # neighbours swaps who goes first.
        for system in systems if rep % 2 == 0 else systems[::-1]:
            # Untimed: the first HF run after our engine ran pays ~1.5-2 s extra at batch 64 (it goes away
            # with MALLOC_MMAP_THRESHOLD_ pinned, so it looks like glibc returning memory that the big padded
            # tensors then fault in again) — a cost an HF user running HF alone never sees, which would
            # otherwise land entirely in T(1) and inflate HF's decode rate.
            system.run(prompts, 1)
            t1, _ = system.run(prompts, 1)
            tn, outputs[system.name] = system.run(prompts, new_tokens)
            times[system.name][0].append(t1)
            times[system.name][1].append(tn)
            # A system that keeps the cores busy a while after it answers (vLLM's polling readers) would
            # slow whichever system is timed next: wait until it is quiet.
            time.sleep(_settle_s(system))
        rep += 1
        line = " | ".join(f"{n} T(1)={t[0][-1]:.3f}s T(N)={t[1][-1]:.3f}s" for n, t in times.items())
        log(f"  b{len(prompts)} repeat {rep}: {line}")
    prompt_tokens = sum(len(p) for p in prompts)
    rates = {n: Rates.of(*t, prompt_tokens, len(prompts), new_tokens) for n, t in times.items()}
    return Timed(rates, outputs, rep)
