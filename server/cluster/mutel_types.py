"""The frozen snapshots and results Mutel's decisions (`server.cluster.mutel`) take and give: an instance's
role and state, a turn, the cost coefficients, the SLOs, a rejection and a prefill choice."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import ClassVar, Literal

__all__ = [
    "CostModel", "Fetch", "InstanceView", "PrefillChoice", "RejectReason", "Rejection", "Role", "Slo",
    "TurnRequest",
]  # fmt: skip

Fetch = Literal["move", "recompute"]


class Role(enum.Enum):
    """What an instance runs: prompts, decode steps, or both (colocated, vLLM-like)."""

    PREFILL = "prefill"
    DECODE = "decode"
    BOTH = "both"

    @property
    def prefills(self) -> bool:
        return self is not Role.DECODE

    @property
    def decodes(self) -> bool:
        return self is not Role.PREFILL


@dataclass(frozen=True)
class CostModel:
    """Step-time coefficients of one instance (the fields of `server.sim.latency.LatencyModel`, seconds)
    and the link between instances (bytes per second, seconds per message)."""

    base_s: float
    prefill_token_s: float
    prefill_pair_s: float
    decode_seq_s: float
    kv_token_s: float
    kv_bytes_per_token: int
    link_bytes_per_s: float
    link_latency_s: float

    def move_s(self, tokens: int) -> float:
        """Time to send ``tokens`` tokens of KV over the link (nothing to send costs nothing)."""
        if tokens <= 0:
            return 0.0
        return self.link_latency_s + tokens * self.kv_bytes_per_token / self.link_bytes_per_s

    def prefill_s(self, tokens: int, cached: int) -> float:
        """Compute of ``tokens`` new prompt tokens after ``cached`` tokens of KV (no per-step base)."""
        pairs = tokens * cached + tokens * (tokens + 1) // 2  # token i attends cached + i + 1 keys
        return tokens * self.prefill_token_s + pairs * self.prefill_pair_s


@dataclass(frozen=True)
class InstanceView:
    """A snapshot of one instance. ``kv_used`` excludes idle conversations' KV kept for reuse (``held``:
    conversation -> tokens), which is evicted when room is needed; ``kv_waiting``: KV that a turn waiting
    for room here needs. ``decode_step_s``: its decode step time now (0: no decodes);
    ``prefill_s_per_token``: its recent prefill time per token (0: use the model's)."""

    index: int
    role: Role
    kv_capacity: int
    kv_used: int = 0
    queued_prefill_tokens: int = 0
    running_decodes: int = 0
    decode_step_s: float = 0.0
    prefill_s_per_token: float = 0.0
    held: Mapping[int, int] = field(default_factory=dict)
    kv_waiting: int = 0

    @property
    def kv_free(self) -> int:
        return self.kv_capacity - self.kv_used


@dataclass(frozen=True)
class TurnRequest:
    """A turn: its new prompt after ``history_tokens`` of earlier prompts and answers, and the answer
    length expected (a prediction; the simulator knows it)."""

    conversation: int
    turn: int
    prompt_tokens: int
    history_tokens: int
    expected_output_tokens: int

    @property
    def context_tokens(self) -> int:
        return self.history_tokens + self.prompt_tokens


@dataclass(frozen=True)
class Slo:
    """Latency objectives, each met by the 90th percentile of requests."""

    ttft_s: float
    tpot_s: float


class RejectReason(enum.Enum):
    """Why a turn is refused (`Rejection`)."""

    TTFT = "ttft_slo"
    TPOT = "tpot_slo"
    NO_CAPACITY = "no_capacity"


@dataclass(frozen=True)
class Rejection:
    """An early rejection: why, what was predicted and the limit it missed. Answered as HTTP 503."""

    http_status: ClassVar[int] = 503
    reason: RejectReason
    predicted_s: float = 0.0
    limit_s: float = 0.0

    @property
    def message(self) -> str:
        if self.reason is RejectReason.NO_CAPACITY:
            return "no instance has room for this conversation's KV cache"
        what = "time to first token" if self.reason is RejectReason.TTFT else "time per output token"
        return f"overloaded: predicted {what} {self.predicted_s:.3f} s exceeds its SLO, {self.limit_s:.3f} s"


@dataclass(frozen=True)
class PrefillChoice:
    """Where a turn's prompt runs, the KV reused there, how the rest gets there, the tokens to compute."""

    instance: int
    reused_tokens: int
    fetch: Fetch
    compute_tokens: int
    predicted_ttft_s: float
