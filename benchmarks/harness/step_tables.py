"""The tables of `benchmarks.gpu_steps`' measurements (a batch's step anatomy, the grouping sweep), printed
by the benchmark and rendered on the results page from its record."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from benchmarks.harness.output import markdown_table

MODES = ("never", "always", "auto")


def anatomy_table(steps: Sequence[Mapping[str, Any]]) -> str:
    """Per batch and layer ops: the fill's wall time, a decode step's wall and device time (ms)."""
    rows = [
        [
            str(s["batch"]),
            s["ops"],
            f"{s['fill_ms']:.1f}",
            f"{s['step_ms']:.2f}",
            f"{s.get('device_ms', float('nan')):.2f}",
        ]
        for s in steps
    ]
    headers = ["batch", "layer ops", "fill ms", "step ms", "device ms"]
    return markdown_table(headers, rows, [True, False, True, True, True])


def grouping_table(groups: Sequence[Mapping[str, Any]]) -> str:
    """Per batch and prefix: the mean decode step per ``shared_prefix_decode`` mode, and how many steps
    the gate (``auto``) grouped."""
    rows = [
        [
            str(g["batch"]),
            str(g["prefix"]),
            *(f"{g['step_ms'][m]:.2f}" for m in MODES),
            f"{g['grouped_vs_graphed']:.2f}x",
            str(g["grouped_steps"]["auto"]),
        ]
        for g in groups
    ]
    headers = ["batch", "prefix", *(f"{m} ms" for m in MODES), "never/always", "auto grouped steps"]
    return markdown_table(headers, rows, [True] * 7)
