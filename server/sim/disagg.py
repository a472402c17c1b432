"""Prefill/decode disaggregation for multi-turn chat on a simulated GPU cluster: policies, results, and the
highest request rate each sustains under P90 TTFT and TPOT SLOs.

Three policies, all deciding with `server.cluster.mutel` (the baselines with its features off):

* ``colocated`` (vLLM-like) — every instance prefills and decodes; a conversation's KV stays cached where
  it ran (prefix caching; routing by locality, unless that instance's decodes would pass their TPOT SLO);
  prompts run in chunks beside the decodes, sized by `chunk_size` to the TPOT budget (chunked prefill), so
  a prompt inflates the decodes' step only that much. ``Policy(reuse_kv=False, chunked=False)``: vLLM's
  old defaults, every turn recomputing its history and whole prompts run beside the decodes;
* ``splitwise`` (Splitwise-like) — prefill instances load the conversation's history KV from host memory
  (or recompute it, by `move_or_recompute`), compute the prompt and send the whole context's KV to a
  decode instance, then drop it; the decode instance holds the whole context and, when the turn ends,
  writes the turn's new KV to host memory for the next turn;
* ``mutel`` — the prefill instance keeps the prompt KV (locality for the next turn); the decode instance
  holds only generated tokens; each decode step's attention over the prompt runs on the prefill instance
  (exchange per layer), whose prompt chunks are sized so that attention waits at most that long; the
  generated KV moves back to the prefill instance when the turn ends. When prefill memory is what holds
  turns back, a turn's prompt KV moves to its decode instance instead (KV balancing, `balance_kv`).
  Early rejection against the SLOs.

Every instance writes a turn's new KV to host memory when the turn ends (incremental: the rest is there
already), so an evicted or moved conversation is loaded back from host or recomputed, whichever is faster.
The event engine is `server.sim.disagg_events` (and `server.sim.disagg_decode`); its model is stated there
and in `server.sim.disagg_cost`, the workload in `server.sim.disagg_workload`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from server.cluster.mutel import Slo
from server.sim.disagg_cost import ClusterCost
from server.sim.disagg_events import ClusterSim
from server.sim.disagg_types import POLICIES, Policy, SimResult, TurnRecord, p90
from server.sim.disagg_workload import Conversation, WorkloadSpec, at_rate

__all__ = [
    "POLICIES", "Policy", "RateSearch", "SimResult", "TurnRecord", "max_sustained_rate", "p90", "simulate",
]  # fmt: skip


def simulate(
    policy: Policy,
    slo: Slo,
    conversations: list[Conversation],
    cost: ClusterCost,
    *,
    warmup: float = 0.2,
    drain_s: float = 300.0,
    stop_on_fail: bool = True,
) -> SimResult:
    """Serve ``conversations`` (start times as given) under ``policy``; deterministic. Turns arriving in
    the first ``warmup`` of the start window are not measured; the run ends ``drain_s`` after the last
    conversation starts (unfinished turns are misses), or, with ``stop_on_fail``, as soon as more than a
    tenth of the workload's turns missed an SLO (the run cannot meet it any more)."""
    return ClusterSim(policy, slo, conversations, cost, warmup, drain_s, stop_on_fail).run()


@dataclass(frozen=True)
class RateSearch:
    """The highest conversation start rate found to meet the SLOs, as conversations and turns per second
    (offered: rejected turns included), every rate tried with its outcome, and the share of measured turns
    refused early at that rate (they count as misses, within the 10% the P90s allow)."""

    conversations_per_s: float
    requests_per_s: float
    tried: tuple[tuple[float, bool], ...]
    rejected_share: float = 0.0


def max_sustained_rate(
    policy: Policy,
    slo: Slo,
    workload: WorkloadSpec,
    cost: ClusterCost,
    *,
    duration_s: float = 600.0,
    start: float = 1.0,
    tolerance: float = 0.05,
    **options: Any,
) -> RateSearch:
    """Bisection over the conversation start rate, each run ``duration_s`` of starts (the same
    conversations at every rate, more of them at a higher one): double or halve from ``start`` until a
    passing and a failing rate bracket the limit, then bisect geometrically until they are within
    ``tolerance``. 0 when even ``start / 2**10`` fails. ``options`` go to `simulate`."""
    tried: list[tuple[float, bool]] = []
    rejected: dict[float, float] = {}  # by passing rate

    def ok(rate: float) -> bool:
        result = simulate(policy, slo, at_rate(workload, rate, duration_s), cost, **options)
        tried.append((rate, result.meets))
        if result.meets:
            rejected[rate] = sum(r.rejected is not None for r in result.measured) / max(
                1, len(result.measured)
            )
        return result.meets

    lo: float | None = None
    hi: float | None = None
    rate = start
    while lo is None or hi is None:
        if ok(rate):
            lo, rate = rate, rate * 2
        else:
            hi, rate = rate, rate / 2
        if lo is None and rate < start / 2**10:
            return RateSearch(0.0, 0.0, tuple(tried))
    while hi / lo > 1 + tolerance:
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    turns = sum(len(c.turns) for c in at_rate(workload, lo, duration_s))
    return RateSearch(lo, turns / duration_s, tuple(tried), rejected[lo])
