"""The plain types of `server.sim.disagg`: a policy and its split, one turn's record, a run's result."""

from __future__ import annotations

import math
from dataclasses import dataclass

from server.cluster.mutel import RejectReason, Role, Slo

__all__ = ["POLICIES", "Policy", "SimResult", "TurnRecord", "p90"]

POLICIES = ("colocated", "splitwise", "mutel")


@dataclass(frozen=True)
class Policy:
    """A policy on ``instances`` GPUs, ``prefill_instances`` of them prefill-only (the rest decode-only;
    colocated: 0, all do both). ``admission``: early rejection (Mutel's; off for the baselines).
    ``chunked``: prompt chunks sized to the TPOT budget, between ``min_chunk`` and ``max_chunk`` tokens
    (else ``max_chunk`` whatever waits on them); at most ``max_num_seqs`` decodes a step. ``reuse_kv``
    False: no KV survives a turn, every turn recomputes its history (vLLM without prefix caching)."""

    name: str
    prefill_instances: int = 0
    instances: int = 4
    admission: bool = False
    chunked: bool = True
    reuse_kv: bool = True
    max_num_seqs: int = 256
    min_chunk: int = 64
    max_chunk: int = 2048

    def __post_init__(self) -> None:
        if self.name not in POLICIES:
            raise ValueError(f"unknown policy {self.name!r}: one of {POLICIES}")
        split = self.prefill_instances
        if (self.name == "colocated") != (split == 0) or split >= self.instances:
            raise ValueError(f"{self.name} cannot run {split} prefill instances of {self.instances}")

    @classmethod
    def of(cls, name: str, prefill_instances: int = 2, **options: object) -> Policy:
        """``name`` with its defaults: colocated on all instances and with no minimum chunk (Sarathi's
        rule: a chunk never pushes the decodes past their TPOT; they thin out and make room), early
        rejection for Mutel only. A prefill-only instance's chunk pays the weight read alone, so there a
        chunk has at least 64 tokens."""
        split = 0 if name == "colocated" else prefill_instances
        defaults: dict[str, object] = {"admission": name == "mutel", "min_chunk": 0 if split == 0 else 64}
        return cls(name, split, **{**defaults, **options})  # type: ignore[arg-type]

    @property
    def label(self) -> str:
        if self.name == "colocated":
            label = f"colocated {self.instances}x"
        else:
            label = f"{self.name} {self.prefill_instances}P+{self.instances - self.prefill_instances}D"
        return label + ("" if self.reuse_kv else " no-reuse") + ("" if self.chunked else " unchunked")

    def roles(self) -> list[Role]:
        if self.name == "colocated":
            return [Role.BOTH] * self.instances
        return [Role.PREFILL] * self.prefill_instances + [Role.DECODE] * (
            self.instances - self.prefill_instances
        )


@dataclass(eq=False)
class TurnRecord:
    """One turn's life: when it arrived, its first token, its last, or why it was rejected. ``measured``:
    it arrived inside the measurement window (after the warm-up, before the last conversation started)."""

    id: int
    conversation: int
    turn: int
    arrival_s: float
    history_tokens: int
    prompt_tokens: int
    output_tokens: int
    measured: bool
    first_s: float = math.nan
    done_s: float = math.nan
    rejected: RejectReason | None = None
    prefill: int = -1
    decode: int = -1
    # the event engine's working state
    context_on_decode: bool = False  # the context's KV moved to the decode instance (else Mutel's remote)
    todo: int = 0  # prompt tokens still to compute
    cached: int = 0  # KV tokens present on the prefill instance
    local0: int = 0
    join_step: int = 0

    @property
    def context_tokens(self) -> int:
        return self.history_tokens + self.prompt_tokens

    @property
    def ttft_s(self) -> float:
        return math.inf if math.isnan(self.first_s) else self.first_s - self.arrival_s

    @property
    def tpot_s(self) -> float:
        if math.isnan(self.done_s):
            return math.inf
        return (self.done_s - self.first_s) / max(1, self.output_tokens - 1)


def p90(values: list[float]) -> float:
    """Nearest-rank 90th percentile (so infinities, for rejected or unfinished turns, count as misses)."""
    if not values:
        return math.nan
    return sorted(values)[max(0, math.ceil(0.9 * len(values)) - 1)]


@dataclass(frozen=True)
class SimResult:
    """A run: every turn, the bytes moved by kind (``kv_to_decode``, ``history_load``, ``kv_back``,
    ``host_write``, ``exchange``), each instance's peak KV (tokens, cached included) against its capacity,
    and whether the run stopped early because the SLOs were already lost."""

    policy: Policy
    slo: Slo
    records: tuple[TurnRecord, ...]
    moved_bytes: dict[str, int]
    peak_kv: tuple[int, ...]
    kv_capacity: int
    aborted: bool
    end_s: float

    @property
    def measured(self) -> list[TurnRecord]:
        return [r for r in self.records if r.measured]

    @property
    def p90_ttft_s(self) -> float:
        return p90([r.ttft_s for r in self.measured])

    @property
    def p90_tpot_s(self) -> float:
        return p90([r.tpot_s for r in self.measured])

    @property
    def meets(self) -> bool:
        """P90 TTFT and P90 TPOT within the SLO (rejected and unfinished turns are misses)."""
        return not self.aborted and self.p90_ttft_s <= self.slo.ttft_s and self.p90_tpot_s <= self.slo.tpot_s
