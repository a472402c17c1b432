"""A simulated experiment repeated over workload seeds: every system's result per seed, and the headline
ratios (a baseline's metric over Parrot's) with their median and range over the seeds.

Each seed is a new draw of the workload (arrivals, lengths, documents). Within one seed every system saw the
same requests, so a ratio is taken there (`SeedRun.ratio`) and only then summarized over the seeds
(`spread`): a seed that is hard for every system does not pass for one system's gain.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from benchmarks.harness.stats import Spread, safe_ratio

__all__ = ["Headline", "Result", "SeedRun", "ratio_cell", "spread"]

# RESULT key -> (the metric, the baseline whose value is divided by Parrot's, the paper's ratio).
Headline = Mapping[str, tuple[str, str, float]]


class Result(Protocol):
    """One system's run on one seed's workload."""

    def metrics(self) -> dict[str, float]: ...

    def as_dict(self) -> dict[str, Any]: ...


@dataclass
class SeedRun:
    """Every system on the workload of one seed: what the workload offered (``summary``), each system's
    result, the headline ratios and which system is Parrot (the denominator)."""

    summary: dict[str, Any]
    systems: dict[str, Result]
    headline: Headline
    parrot: str

    def ratio(self, metric: str, baseline: str, parrot: str | None = None) -> float:
        """Baseline / Parrot of one metric (above 1: Parrot better)."""
        ours = self.systems[parrot or self.parrot].metrics()[metric]
        return safe_ratio(self.systems[baseline].metrics()[metric], ours)

    def ratios(self, parrot: str | None = None) -> dict[str, float]:
        """The headline ratios, keyed as the headline (``parrot``: another system as the denominator)."""
        return {
            key: self.ratio(metric, baseline, parrot) for key, (metric, baseline, _) in self.headline.items()
        }

    def as_dict(self) -> dict[str, Any]:
        systems = {name: r.as_dict() for name, r in self.systems.items()}
        return {"workload": self.summary, "ratios": self.ratios(), "systems": systems}


def spread(runs: Sequence[SeedRun], key: str, system: str | None = None) -> Spread:
    """A headline ratio (a key of the headline; ``system`` as Parrot) or one system's metric (``system``:
    Parrot unless named), over the seeds."""
    if key in runs[0].headline:
        return Spread.of(r.ratios(system)[key] for r in runs)
    return Spread.of(r.systems[system or r.parrot].metrics()[key] for r in runs)


def ratio_cell(s: Spread) -> str:
    """A ratio over seeds in a table: its median, and its range when there was more than one seed."""
    return f"{s.median:.2f}x" + (f" ({s.lo:.2f}-{s.hi:.2f})" if s.n > 1 else "")
