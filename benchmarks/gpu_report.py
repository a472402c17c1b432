"""The results page's GPU section, rendered from ``benchmarks/results/gpu.json`` (`benchmarks.gpu`'s record).

The GPU runs on a machine lent by chance, not through the runner, so its record is its own file and this
section its own part of the page: the GPU, the tests, the kernels, the engine against HF ``generate`` and
the simulator profile fitted there, each against the goals of the GPU issue.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from benchmarks.harness.output import markdown_table
from benchmarks.harness.step_tables import anatomy_table, forced_cell, fresh_fill_table, grouping_table

RECORD = "gpu.json"
# The GPU path's goals: metric, comparison, bound, what it means.
GOALS = (
    (
        "kernel_frac_of_ceiling_b32_p4096",
        ">=",
        0.5,
        "shared-prefix kernel, share of its traffic ceiling, b32, 4k",
    ),
    (
        "kernel_frac_of_ceiling_b64_p4096",
        ">=",
        0.5,
        "shared-prefix kernel, share of its traffic ceiling, b64, 4k",
    ),
    ("decode_ratio_vs_hf_b64", ">=", 3.0, "engine decode vs HF generate at batch 64 (7B shape)"),
    ("floor_ratio_b1_llama-2-7b", "<=", 1.35, "batch-1 decode time over its memory-bandwidth floor (7B)"),
    (
        "steps_prefill_gathered_over_in_place_c4096_n2048",
        ">=",
        1.2,
        "paged prefill in place vs the gather, 4,096 cached + 2,048 new",
    ),
)
# Beside the goals, for runs on other cards: HF agreement of the 7B's tokens at each batch size.
AGREEMENT = tuple(f"forced_token_agree_b{b}_llama-2-7b" for b in (1, 16, 64))


def load(results_dir: Path) -> dict[str, Any] | None:
    """The GPU record in ``results_dir``, or None when no GPU run was recorded."""
    path = results_dir / RECORD
    return json.loads(path.read_text()) if path.is_file() else None


def _met(value: float, op: str, bound: float) -> bool:
    return value >= bound if op == ">=" else value <= bound


def section(record: Mapping[str, Any]) -> list[str]:
    """Markdown lines of the GPU section."""
    env, metrics = record.get("env", {}), record.get("metrics", {})
    lines = [
        "## gpu",
        "",
        f"**The GPU path, measured** — {record.get('gpu')}, torch {env.get('torch')}, triton "
        f"{env.get('triton')}; `{record.get('command', 'python -m benchmarks.gpu --out DIR')}` at "
        f"{record.get('measured_at', '?')}, commit `{record.get('commit', '?')}`. Models are random-weight "
        "LLaMAs at real shapes (`benchmarks/harness/random_models.py`): speed does not depend on weights.",
        "",
    ]
    rows = []
    for key, op, bound, label in GOALS:
        value = metrics.get(key)
        verdict = "—" if value is None else "✓" if _met(value, op, bound) else "✗"
        shown = "not measured" if value is None else f"{value:.2f}"
        rows.append([label, f"`{key}`", shown, f"{op} {bound:g}", verdict])
    lines += [markdown_table(["Goal", "Metric", "Ours", "Goal", ""], rows, [False, False, True, True, False])]
    tests = record.get("tests") or {}
    if tests:
        partial = " (stopped by the run's time budget before the end)" if tests.get("incomplete") else ""
        lines += [
            "",
            f"Tests on the GPU: {tests['tests']} run, {tests['failures']} failed, {tests['errors']} errors, "
            f"{tests['skipped']} skipped{partial}.",
            *([tests["note"]] if tests.get("note") else []),
        ]
    lines += [
        "",
        *_kernels(record),
        "",
        *_engine(record),
        "",
        *_steps(record if _anatomy(record) else record.get("after_layer_kernels") or {}),
        *_diagnostics(record.get("diagnostics") or {}),
        *_other_cards(record),
    ]
    profile = record.get("profile")
    if profile:
        coefficients = ", ".join(
            f"{k} {profile[k]:.3g} s"
            for k in ("base", "prefill_token", "prefill_pair", "decode_seq", "kv_token")
        )
        fitted = record.get("profile_note") or "Fitted on this run."
        lines += ["", f"Simulator profile `{profile['name']}`: {coefficients}. {fitted}", ""]
    return lines


def _anatomy(record: Mapping[str, Any]) -> bool:
    return bool(((record.get("payloads") or {}).get("steps") or {}).get("anatomy"))


def _diagnostics(diag: Mapping[str, Any]) -> list[str]:
    """The follow-up measurements of a run (why a goal is missed, where time goes), with their notes."""
    rows = [
        [
            str(r["batch"]),
            f"{r['plain_shared_blocks_ms']:.3f}",
            f"{r['plain_distinct_blocks_ms']:.3f}",
            f"{r['plain_shared_TBps_equiv']:.2f}",
            f"{r['plain_distinct_TBps']:.2f}",
        ]
        for r in diag.get("kernel_l2", [])
    ]
    lines: list[str] = []
    if rows:
        headers = ["batch", "paged ms, shared blocks", "paged ms, own copies", "TB/s shared", "TB/s own"]
        table = markdown_table(headers, rows, [True] * len(headers))
        lines += ["", table, "", diag.get("kernel_l2_note", "")]
    if diag.get("fill_note"):
        lines += ["", diag["fill_note"]]
    return lines


def _kernels(record: Mapping[str, Any]) -> list[str]:
    payload = (record.get("payloads") or {}).get("kernels_bf16") or {}
    if not payload.get("rows"):
        return []
    private = any(r.get("speedup_vs_private") is not None for r in payload["rows"])  # null: not measured
    rows = [
        [
            str(r["batch"]),
            str(r["prefix"]),
            f"{r['plain_ms']:.3f}",
            f"{r['shared_ms']:.3f}",
            f"{r['speedup']:.2f}x",
            f"{r['ceiling']:.2f}x",
            f"{r.get('plain_wall_ms', float('nan')):.3f} / {r.get('shared_wall_ms', float('nan')):.3f}",
        ]
        + ([f"{r['plain_private_ms']:.3f}", f"{r['speedup_vs_private']:.2f}x"] if private else [])
        for r in payload["rows"]
    ]
    headers = ["batch", "prefix", "paged ms", "shared ms", "speedup", "ceiling", "wall ms paged / shared"]
    headers += ["paged ms, own prefix copies", "speedup vs own copies"] if private else []
    return [
        "Shared-prefix vs paged decode attention, one layer (GQA 32/8, head dim 128, bf16, suffix 256): "
        "device time with the L2 cache flushed before each call; the wall time of an eager call beside it.",
        "",
        markdown_table(headers, rows, [True] * len(headers)),
    ]


def _engine(record: Mapping[str, Any]) -> list[str]:
    payload = (record.get("payloads") or {}).get("engine") or {}
    rows = []
    for shape in payload.get("shapes", []):
        for r in shape.get("rows", []):
            eager = r.get("ours_eager", {}).get("decode_tps")
            rows.append(
                [
                    shape["shape"],
                    str(r["batch"]),
                    f"{r['ours']['decode_tps']:.0f}",
                    "—" if eager is None else f"{eager:.0f}",
                    f"{r['hf']['decode_tps']:.0f}",
                    f"{r['decode_ratio_vs_hf']:.2f}x",
                    f"{r['prefill_ratio_vs_hf']:.2f}x",
                    f"{r['same_tokens_hf']:.0%}",
                    forced_cell(r),
                ]
            )
    if not rows:
        return []
    headers = [
        "shape",
        "batch",
        "ours decode tok/s",
        "ours eager",
        "HF",
        "ours/HF",
        "prefill ours/HF",
        "same tok",
        "forced tok (HF self)",
    ]
    return [
        "Engine decode (CUDA graphs on; *eager*: the same engine with them off, same weights) against HF "
        "`generate`, bf16, prompts 128-256 tokens, 32 new tokens. Random weights leave near-ties, so bf16 "
        "greedy tokens agree with HF's only in part (*same tok*: whole sequences); graphs and eager agree on "
        "every token. *forced tok*: the share of our tokens that are HF's own argmax with HF run "
        "teacher-forced over them, each position on its own prefix (in brackets HF's own `generate` tokens, "
        "the same way: its cached decode rounds differently too; runs before the sixth have none).",
        "",
        markdown_table(headers, rows, [False] + [True] * (len(headers) - 1)),
    ]


def _steps(after: Mapping[str, Any]) -> list[str]:
    """The re-measurement after the Triton layer kernels and grouped graphs (`benchmarks.gpu_steps`)."""
    steps = (after.get("payloads") or {}).get("steps") or {}
    if not steps.get("anatomy"):
        return []
    lines = [
        f"Decode-step anatomy (commit `{after.get('commit', '?')}`, {steps.get('shape')}): a decode step's "
        "wall time (the engine's step trace) and its kernels' device time (torch.profiler), with the fused "
        "layer kernels and with torch's ops over the same weights; *fill ms*: the fill of the batch's "
        "256-token prompts, the device waited for.",
        "",
        anatomy_table(steps["anatomy"]),
        "",
        "Forks of one prefix (each with 128 tokens of its own), mean graphed decode step: plain paged "
        "decode (`never`), grouped by shared prefix (`always`), the engine's gate (`auto`).",
        "",
        grouping_table(steps.get("grouping", [])),
    ]
    prefill = steps.get("paged_prefill") or []
    if prefill:
        cases = ", ".join(
            f"{r['cached']} cached + {r['chunk']}: {r['gathered_ms']:.2f} vs {r['in_place_ms']:.2f} ms"
            for r in prefill
        )
        lines += [
            "",
            "One layer's attention of a fill chunk after cached tokens, gathered + SDPA vs in place through "
            f"the shared-prefix kernel ({cases}): the gather stays the default.",
        ]
    fills = steps.get("fresh_fill") or []
    if fills:
        lines += [
            "",
            "A step of fresh fills (prompts of 128-256 tokens, nothing cached), its attention two ways as "
            "the engine thread sees it: the step's plan plus every layer's call, wall time with the device "
            "waited for; length groups (padded batched calls) vs one varlen FlashAttention call; *layer "
            "device ms*: one layer's kernels alone.",
            "",
            fresh_fill_table(fills),
        ]
    return lines


def _other_cards(record: Mapping[str, Any]) -> list[str]:
    """The goals' metrics of runs on other cards (``other_cards``) beside this record's, with their notes."""
    cards = record.get("other_cards") or []
    if not cards:
        return []
    keys = [key for key, *_ in GOALS] + list(AGREEMENT)

    def cell(metrics: Mapping[str, Any], key: str) -> str:
        value = metrics.get(key)
        return "—" if value is None else f"{value:.3g}"

    headers = ["Metric", f"{record.get('gpu')} ({record.get('measured_at', '?')})"]
    headers += [f"{c.get('gpu')} ({c.get('measured_at', '?')})" for c in cards]
    rows = [
        [f"`{k}`", cell(record.get("metrics", {}), k), *(cell(c.get("metrics", {}), k) for c in cards)]
        for k in keys
    ]
    lines = [
        "",
        "Runs on other cards, beside this one:",
        "",
        markdown_table(headers, rows, [False] + [True] * (len(headers) - 1)),
    ]
    for c in cards:
        note = c.get("metrics_note")
        lines += [
            "",
            f"{c.get('gpu')}: `{c.get('command', '?')}`, commit `{c.get('commit', '?')}`."
            + (f" {note}" if note else ""),
        ]
    return lines
