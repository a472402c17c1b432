"""The order in which the scheduler admits waiting requests: FCFS, or shortest-job-first with aging (SSJF).

Pure functions over `Queued` entries with the clock passed in, so the rule is tested without an engine.

``fcfs`` (the default): arrival order, with a preempted request back at the head (as it always was).

``sjf``: lower ``priority`` first (the manager sends a generate's predicted output length). The order, first
to last:

1. preempted requests, resumed before anything else in the order they were requeued: priority never takes
   a started request's place, and never preempts one (new work waits; only KV pressure preempts);
2. *aged* requests — queued for at least ``aging_s`` — in arrival order;
3. the rest: latency-critical work (a generate with a ``latency_cap``: the manager sets one exactly for
   latency-bound calls) before throughput work, then by priority, then by arrival. SJF orders *within*
   Parrot's objective classes, never across them.

A request without a priority is ranked as an average one: the mean of the priorities given before it
(0.0 before any was), fixed when it is queued. So traffic that sends no priority at all keeps its arrival
order within each class, and a mix is not starved in either direction.

**The aging bound.** Once a request has been queued for ``aging_s`` seconds (by the engine's clock; a
fork waiting for its busy parent is queued when the parent's request ends), no request queued after it
starts before it: the scheduler admits from the head, and nothing overtakes a head that does not fit. So it
waits at most ``aging_s`` plus the time that the requests queued before it, requests preempted meanwhile and
those already running take to make room — however many shorter requests keep arriving.

**Tenants take turns** (both policies). Among the requests of the last class (neither resumed nor aged), a
request's place is first its *turn* — it is its tenant's k-th such request in the policy's order — then the
policy's order: one tenant's flood of queued requests never holds back another tenant's next request by more
than one request of each tenant. Traffic that names no tenant is one tenant, so its order is the policy's.

The engine has no notion of a task group: a group's members are separate requests. Equal priorities keep
arrival order, so a manager that gives a group's members one priority (and submits them together) keeps
them adjacent in the queue.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, Literal, TypeVar

SchedulingPolicy = Literal["fcfs", "sjf"]
SCHEDULING_POLICIES: tuple[SchedulingPolicy, ...] = ("fcfs", "sjf")
# Long enough that aging only acts under sustained overload, short enough to bound a long request's wait
# on a busy engine to well under a client's usual timeout.
DEFAULT_SJF_AGING_S = 30.0

T = TypeVar("T")


@dataclass(frozen=True)
class Queued(Generic[T]):
    """A waiting ``item`` and what its place in the order depends on."""

    item: T
    seq: int  # arrival order in the queue (ties, and the order of aged requests)
    queued_at: float  # clock time it was queued
    priority: float  # lower runs sooner; a missing priority is already replaced (`default_priority`)
    latency_critical: bool = False  # carries a latency objective: ranked before throughput work
    resumed: bool = False  # preempted after it started: back before everything else
    tenant: str = ""  # who sent it: tenants take turns (`tenant_turns`); "" for traffic that names none


def check_policy(policy: str, aging_s: float) -> None:
    """Raise `ValueError` for an unknown policy or an aging time that is not a finite positive number."""
    if policy not in SCHEDULING_POLICIES:
        raise ValueError(f"unknown scheduling {policy!r}; use one of {', '.join(SCHEDULING_POLICIES)}")
    if isinstance(aging_s, bool) or not isinstance(aging_s, int | float) or not (0 < aging_s < math.inf):
        raise ValueError(
            f"sjf_aging_s must be a finite number of seconds > 0, not {aging_s!r}: without aging a long "
            "request could wait forever behind shorter ones"
        )


def default_priority(given_sum: float, given_count: int) -> float:
    """The priority of a request queued without one: the mean of those given so far (0.0 before any)."""
    return given_sum / given_count if given_count else 0.0


def is_aged(entry: Queued[T], now: float, aging_s: float) -> bool:
    return now - entry.queued_at >= aging_s


def order_waiting(
    queue: Sequence[Queued[T]], now: float, policy: SchedulingPolicy, aging_s: float
) -> list[Queued[T]]:
    """``queue`` (in its current order) in the order to admit it at time ``now`` (see the module doc)."""

    def key(indexed: tuple[int, Queued[T]]) -> tuple[float, ...]:
        position, e = indexed
        if e.resumed:
            return (0, position)
        if policy == "sjf" and is_aged(e, now, aging_s):
            return (1, e.seq)
        if policy == "fcfs":
            return (2, position)
        return (2, 0 if e.latency_critical else 1, e.priority, e.seq)

    keyed = sorted((key(pe), pe[1]) for pe in enumerate(queue))
    turns = tenant_turns([e for k, e in keyed if k[0] == 2])
    return [e for _, e in sorted(keyed, key=lambda ke: (ke[0][0], turns.get(id(ke[1]), 0), ke[0]))]


def tenant_turns(ordered: Sequence[Queued[T]]) -> dict[int, int]:
    """Each entry's turn (by ``id``) in a round robin over tenants: a tenant's k-th entry in ``ordered``
    gets turn k, so one tenant's flood of queued requests never holds back another tenant's next one.
    With one tenant the turns follow ``ordered`` itself."""
    seen: dict[str, int] = {}
    turns: dict[int, int] = {}
    for e in ordered:
        turns[id(e)] = seen.get(e.tenant, 0)
        seen[e.tenant] = turns[id(e)] + 1
    return turns


def next_reorder_at(queue: Sequence[Queued[T]], now: float, aging_s: float) -> float:
    """When the SJF order of an unchanged ``queue`` next changes: the moment its oldest not-yet-aged
    request ages (``math.inf``: never)."""
    pending = [e.queued_at + aging_s for e in queue if not e.resumed and not is_aged(e, now, aging_s)]
    return min(pending, default=math.inf)
