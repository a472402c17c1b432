"""The tables of `benchmarks.gpu_steps`' measurements (a batch's step anatomy, the grouping sweep, the fresh
fill both ways) and the forced-agreement cell of `benchmarks.gpu_engine`'s rows, printed by the benchmarks
and rendered on the results page from their record."""

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


def forced_cell(row: Mapping[str, Any]) -> str:
    """Our tokens that are HF's forced argmax, HF's own in brackets (`harness.forced_agreement`)."""
    if "forced_token_agree" not in row:
        return "—"
    return f"{row['forced_token_agree']:.1%} ({row['forced_token_agree_hf_self']:.1%})"


def fresh_fill_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """`harness.fill_ab`'s rows: one fill step's attention (plan + every layer), length groups vs varlen."""
    headers = ["shape", "prompts", "tokens", "groups ms", "varlen ms", "groups / varlen", "layer device ms"]
    body = [
        [
            r["shape"],
            str(r["batch"]),
            str(r["tokens"]),
            f"{r['groups_step_ms']:.2f}",
            f"{r['varlen_step_ms']:.2f}" if "varlen_step_ms" in r else "—",
            f"{r['groups_over_varlen']:.2f}x" if "groups_over_varlen" in r else r.get("varlen", "—"),
            f"{r['groups_ms']:.3f} / {r['varlen_ms']:.3f}" if "varlen_ms" in r else f"{r['groups_ms']:.3f}",
        ]
        for r in rows
    ]
    return markdown_table(headers, body, [False] + [True] * (len(headers) - 1))
