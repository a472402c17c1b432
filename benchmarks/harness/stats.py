"""How repeated measurements are summarised: the median and range of repeats (`Spread`), percentiles of
latencies (`percentile`) and ratios that survive a failed repeat (`safe_ratio`)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Spread:
    """The median of repeated measurements and their range."""

    median: float
    lo: float
    hi: float
    n: int

    @classmethod
    def of(cls, samples: Iterable[float]) -> Spread:
        xs = [x for x in samples if math.isfinite(x)]
        if not xs:
            return cls(math.nan, math.nan, math.nan, 0)
        return cls(statistics.median(xs), min(xs), max(xs), len(xs))

    @property
    def rel_half_range(self) -> float:
        """Half the range relative to the median (``±`` in the tables)."""
        if not self.median or not math.isfinite(self.median):
            return math.nan
        return (self.hi - self.lo) / 2 / abs(self.median)

    def as_dict(self) -> dict[str, float | int]:
        return {"median": self.median, "min": self.lo, "max": self.hi, "n": self.n}


def percentile(xs: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100), linear between order statistics; NaN for no data."""
    if not xs:
        return math.nan
    ys = sorted(xs)
    pos = (len(ys) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(ys) - 1)
    return ys[lo] + (ys[hi] - ys[lo]) * (pos - lo)


def safe_ratio(a: float, b: float) -> float:
    """``a / b``, NaN when either is unusable (keeps a noisy repeat from crashing the report)."""
    if not (math.isfinite(a) and math.isfinite(b)) or b == 0:
        return math.nan
    return a / b
