"""The load tool's figures (`benchmarks.load`): one wave's throughput, latency, errors and answer consistency
(`summarize`, pure), the whole run's `Report`, its ``RESULT`` metrics and its printed table."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Any

from benchmarks.harness.load_sessions import SessionOutcome
from benchmarks.harness.output import fmt_num, markdown_table
from benchmarks.harness.stats import percentile


@dataclass
class Report:
    """The load's figures, as printed and as the JSON payload's ``report``."""

    sessions: int
    completed: int
    seconds: float
    sessions_per_s: float
    calls_per_s: float
    p50_s: float
    p99_s: float
    errors: int
    errors_by_type: dict[str, int]
    error_examples: dict[str, str]
    lost_variables: int
    inconsistent_chains: int
    rss_before_mb: float
    rss_peak_mb: float
    rss_after_mb: float
    rss_growth_pct: float
    kv_blocks_after: int
    kv_blocks_leaked: float  # NaN: unknown (a server this tool did not start)
    engine_kills: int


def summarize(outcomes: list[SessionOutcome], seconds: float) -> dict[str, Any]:
    """Throughput, latency, errors and answer consistency of one wave (pure)."""
    done = [o for o in outcomes if not o.errors and None not in o.values]
    errors = Counter(k for o in outcomes for k in o.errors)
    examples: dict[str, str] = {}
    for o in outcomes:
        for k, m in zip(o.errors, o.messages, strict=True):
            examples.setdefault(k, m[:300])
    by_seed: dict[int, Counter[tuple[str, ...]]] = {}
    for o in done:
        by_seed.setdefault(o.seed, Counter())[tuple(v or "" for v in o.values)] += 1
    inconsistent = sum(sum(c.values()) - max(c.values()) for c in by_seed.values())
    latencies = [o.seconds for o in done]
    return {
        "sessions": len(outcomes),
        "completed": len(done),
        "seconds": seconds,
        "sessions_per_s": len(done) / seconds if seconds > 0 else math.nan,
        "calls_per_s": 3 * len(done) / seconds if seconds > 0 else math.nan,
        "p50_s": percentile(latencies, 50),
        "p99_s": percentile(latencies, 99),
        "errors": sum(errors.values()),
        "errors_by_type": dict(errors),
        "error_examples": examples,
        "lost_variables": sum(v is None for o in outcomes for v in o.values),
        "inconsistent_chains": inconsistent,
    }


def result_metrics(r: Report) -> dict[str, float | int]:
    """The ``RESULT load`` line's metrics, in its order (a leaked-block count is an integer when known)."""
    leaked: float | int = r.kv_blocks_leaked if math.isnan(r.kv_blocks_leaked) else int(r.kv_blocks_leaked)
    return {
        "sessions": r.sessions,
        "errors": r.errors,
        "p99_s": r.p99_s,
        "rss_growth_pct": r.rss_growth_pct,
        "kv_blocks_leaked": leaked,
        "lost_variables": r.lost_variables,
        "sessions_per_s": r.sessions_per_s,
        "calls_per_s": r.calls_per_s,
        "p50_s": r.p50_s,
        "engine_kills": r.engine_kills,
    }


def table(r: Report) -> str:
    """The printed table of ``r``."""
    rows = [
        ["sessions (completed)", f"{r.sessions} ({r.completed})"],
        ["wall time", f"{r.seconds:.1f} s"],
        ["throughput", f"{r.sessions_per_s:.1f} sessions/s, {r.calls_per_s:.1f} calls/s"],
        ["chain latency p50 / p99", f"{r.p50_s:.2f} s / {r.p99_s:.2f} s"],
        ["errors", f"{r.errors} {r.errors_by_type or ''}".strip()],
        ["lost variables", str(r.lost_variables)],
        ["inconsistent chains", str(r.inconsistent_chains)],
        ["server RSS before / peak / after", f"{fmt_num(r.rss_before_mb)} / {fmt_num(r.rss_peak_mb)} / "
         f"{fmt_num(r.rss_after_mb)} MB ({fmt_num(r.rss_growth_pct, 1)}%)"],
        ["KV blocks in use after (cache dropped)", f"{r.kv_blocks_after} ({fmt_num(r.kv_blocks_leaked)})"],
        ["engine kills", str(r.engine_kills)],
    ]  # fmt: skip
    return markdown_table(["measure", "value"], rows, [False, True])
