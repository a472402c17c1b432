"""Spreads over repeats: the min-max a results file stores for a ratio its ``RESULT`` line printed.

The scripts store a ratio's spread in their JSON payload in one of two shapes — a ``Spread`` dict
(``{"median", "min", "max"}``) below a speedup/ratio key, or ``"<key>": x`` with ``"<key>_range": [lo, hi]``
— and the page finds it by the value printed, so a whisker is shown only where exactly one spread fits.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from typing import Any

from benchmarks.report.goals import finite

# The payload keys under which the scripts store a ratio's spread over repeats; latencies in seconds carry
# the same {median, min, max} shape, so a spread counts only below a key like these.
_RATIO_KEY = re.compile(r"speedup|ratio", re.IGNORECASE)


def as_printed(value: float) -> float:
    """``value`` as a ``RESULT`` line prints it (`benchmarks.harness.output.result_line`: 3 significant
    digits)."""
    return float(f"{value:.3g}") if abs(value) < 1000 else float(f"{value:.0f}")


def spread_candidates(node: Any, ratio_path: bool = False) -> Iterator[tuple[float, float, float]]:
    """Every ``(median, min, max)`` of a ratio stored in ``node``: a ``Spread`` dict (``{"median", "min",
    "max"}``, ``"n"`` at least 2 where stored) below a speedup/ratio key, or a ``"<key>": x`` with its
    ``"<key>_range": [lo, hi]``."""
    if isinstance(node, Mapping):
        stats = [node.get(k) for k in ("median", "min", "max")]
        # A "spread" of one sample (``n`` 1: one seed) has no range to show.
        repeated = not finite(node.get("n")) or node["n"] >= 2
        if ratio_path and repeated and all(finite(v) for v in stats):
            yield stats[0], stats[1], stats[2]
        for key, value in node.items():
            base = str(key).removesuffix("_range")
            if (
                str(key).endswith("_range")
                and _RATIO_KEY.search(base)
                and finite(node.get(base))
                and isinstance(value, list)
                and len(value) == 2
                and all(finite(v) for v in value)
            ):
                yield node[base], value[0], value[1]
            yield from spread_candidates(value, ratio_path or bool(_RATIO_KEY.search(str(key))))
    elif isinstance(node, list):
        for item in node:
            yield from spread_candidates(item, ratio_path)


def stored_spread(payload: Any, value: float) -> tuple[float, float] | None:
    """The min-max over repeats that ``payload`` stores for the ratio its RESULT line printed as ``value``:
    the spread whose median prints the same. None when none does, or when distinct spreads do (a wrong
    whisker would be worse than none)."""
    found = {(lo, hi) for median, lo, hi in spread_candidates(payload) if as_printed(median) == value}
    return next(iter(found)) if len(found) == 1 else None
