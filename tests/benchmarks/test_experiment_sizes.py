"""The benchmarks' shape: each experiment a short file over `benchmarks.harness`."""

from __future__ import annotations

from pathlib import Path

import benchmarks
from benchmarks.experiments import EXPERIMENTS

# An experiment says what it compares, its sizes, systems, workload and ratios; plumbing goes to the harness.
MAX_LINES = 250


def test_every_experiment_stays_short() -> None:
    root = Path(benchmarks.__file__).parent
    sizes = {e.name: len((root / f"{e.name}.py").read_text().splitlines()) for e in EXPERIMENTS}
    too_long = {name: n for name, n in sizes.items() if n > MAX_LINES}
    assert not too_long, f"over {MAX_LINES} lines (move what they share into benchmarks/harness): {too_long}"
