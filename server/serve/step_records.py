"""What the manager did with each step: a small typed record per step (where it ran, for which objective,
how long it queued and ran, how many prompt tokens sharing saved it), and histograms over all steps for
``/metrics``. Plain data, updated by the manager at the edges of a step's life; read by the live view and
the metrics collector.
"""

from __future__ import annotations

import bisect
from collections import Counter
from dataclasses import dataclass, field
from typing import Literal

from server.serve.variables import StepId

__all__ = ["Histogram", "StepRecord", "StepRecords", "task_group_key"]

StepState = Literal["queued", "running", "done", "failed"]

# Bucket bounds: seconds (queue and run time) and tokens (prefill saved).
SECONDS_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 60.0)
TOKEN_BUCKETS = (0, 16, 64, 256, 1024, 4096, 16384)


@dataclass
class StepRecord:
    """One step of one call: its place in the session's DAG, and what happened to it (times in seconds on
    the manager's clock)."""

    session_id: str
    call_id: str
    index: int
    var_id: str
    function: str | None
    criteria: str | None
    task_group: str | None
    queued_at: float
    state: StepState = "queued"
    engine: str | None = None  # how messages name it (`Manager.engine_name`)
    engine_id: int | None = None
    attempts: int = 0
    prompt_tokens: int = 0
    prefill_tokens_saved: int = 0  # prompt tokens forked from a kept context instead of computed
    started_at: float | None = None
    finished_at: float | None = None
    error: str | None = None

    @property
    def queue_s(self) -> float | None:
        """From dispatch to the start on its (last) engine."""
        return None if self.started_at is None else self.started_at - self.queued_at

    @property
    def run_s(self) -> float | None:
        """From the start on its engine to the end (transforms included)."""
        if self.started_at is None or self.finished_at is None:
            return None
        return self.finished_at - self.started_at


@dataclass
class Histogram:
    """Cumulative-bucket counts and a sum, as Prometheus histograms are exported."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)  # per bound, then +Inf
    total: float = 0.0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value

    def buckets(self) -> list[tuple[str, int]]:
        """``(upper bound, cumulative count)`` pairs, ``+Inf`` last."""
        out, running = [], 0
        for bound, count in zip([*map(str, self.bounds), "+Inf"], self.counts, strict=True):
            running += count
            out.append((bound, running))
        return out


@dataclass
class StepRecords:
    """Every live session's step records (in dispatch order), and histograms over every finished step."""

    by_session: dict[str, list[StepRecord]] = field(default_factory=dict)
    queue_s: Histogram = field(default_factory=lambda: Histogram(SECONDS_BUCKETS))
    run_s: Histogram = field(default_factory=lambda: Histogram(SECONDS_BUCKETS))
    prefill_saved: Histogram = field(default_factory=lambda: Histogram(TOKEN_BUCKETS))
    # Per engine id: finished steps that forked a kept context, and the prompt tokens that spared them.
    prefix_hits: Counter[int] = field(default_factory=Counter)
    prefix_tokens_saved: Counter[int] = field(default_factory=Counter)

    def add(self, record: StepRecord) -> StepRecord:
        self.by_session.setdefault(record.session_id, []).append(record)
        return record

    def started(self, record: StepRecord, engine_id: int, engine: str, now: float) -> None:
        """The step begins on engine ``engine_id`` (named ``engine``; again, after a failed engine)."""
        record.state, record.engine, record.started_at = "running", engine, now
        record.engine_id = engine_id
        record.attempts += 1
        record.prefill_tokens_saved = 0

    def ended(self, record: StepRecord, now: float, error: str | None = None) -> None:
        """The step is done (``error`` None) or failed; finished steps count in the histograms."""
        record.finished_at = now
        record.state, record.error = ("done", None) if error is None else ("failed", error)
        if record.queue_s is not None:
            self.queue_s.observe(record.queue_s)
        if record.run_s is not None:
            self.run_s.observe(record.run_s)
        if error is None:
            self.prefill_saved.observe(record.prefill_tokens_saved)
            if record.prefill_tokens_saved and record.engine_id is not None:
                self.prefix_hits[record.engine_id] += 1
                self.prefix_tokens_saved[record.engine_id] += record.prefill_tokens_saved

    def drop_session(self, session_id: str) -> None:
        self.by_session.pop(session_id, None)


def task_group_key(group: StepId | None) -> str | None:
    """How records and the wire name a task group: ``call_id/index`` of the consumer step, or None."""
    return None if group is None else f"{group.call_id}/{group.index}"
