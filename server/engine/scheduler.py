"""Forms each engine step: which requests run and how many of their pending tokens, under the budgets.

Order of service: running decodes first (one token each, latency), then running fills chunked to the token
budget, then waiting requests admitted from the head of the waiting queue while the running-sequence cap and
the token caps allow. The queue's order is the engine's ``scheduling`` (`server.engine.ordering`): arrival
order (``fcfs``), or shortest priority first with aging (``sjf``). When
KV blocks run short, room is made by evicting idle contexts' private KV (least recently used first), then —
for running work only — by preempting the newest running request (its KV is dropped and recomputed later;
its tokens are kept, so nothing is lost). New work never preempts running work: it waits.

Token caps (the rule of the manager's `EngineState.cap_for`, enforced here too, so traffic that bypasses the
manager's placement is capped as well): each request reserves `reserved_tokens`. The head of the waiting
queue is admitted only if the running reservations plus its own stay within ``max_running_tokens`` (if
set), within the smallest ``latency_cap`` of the running requests (while any runs latency work), and within
its own ``latency_cap`` (if it has one). A head that does not fit blocks the queue (nothing behind it
overtakes it: what bounds an aged request's wait under ``sjf``). When nothing runs, the head is admitted
whatever its size: alone it cannot wait for room.
"""

from __future__ import annotations

import itertools
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from server.engine.context import Context, ContextTable
from server.engine.ordering import (
    DEFAULT_SJF_AGING_S,
    Queued,
    SchedulingPolicy,
    check_policy,
    default_priority,
    next_reorder_at,
    order_waiting,
)
from server.engine.request import Request


@dataclass(frozen=True)
class ScheduledChunk:
    """``num_tokens`` pending tokens of ``request``'s context run this step (0: sample from stored state)."""

    request: Request
    num_tokens: int


def reserved_tokens(req: Request) -> int:
    """The tokens ``req`` holds in the running batch: its context's own tokens (what it inherited from the
    context it was forked from is counted once, by whichever request extends that context, not by every
    fork) plus, for a generate, the tokens it may still sample. Constant while it runs: a sampled token
    moves from the second term to the first."""
    ctx = req.context
    own = len(ctx.token_ids) - ctx.num_inherited
    if req.sampling is None:
        return own  # a fill on a fresh context or fork: exactly its pending tokens
    return own + max(0, req.sampling.max_tokens - len(req.output_ids))


class Scheduler:
    """Forms each step's batch (see the module doc). ``scheduling`` orders the waiting queue
    (`server.engine.ordering`); ``clock`` (seconds, monotonic) times its aging."""

    def __init__(
        self,
        table: ContextTable,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        max_running_tokens: int | None = None,
        *,
        scheduling: SchedulingPolicy = "fcfs",
        sjf_aging_s: float = DEFAULT_SJF_AGING_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        check_policy(scheduling, sjf_aging_s)
        self.table = table
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.max_running_tokens = max_running_tokens  # FIFO token cap on the running batch (None: none)
        self.scheduling: SchedulingPolicy = scheduling
        self.sjf_aging_s = sjf_aging_s
        self.clock = clock
        self.waiting: deque[Request] = deque()  # in admission order (under sjf, as of the last step)
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.num_evictions = 0
        self._queued: dict[Request, Queued[Request]] = {}  # what orders each waiting request
        self._arrivals = itertools.count()
        self._priority_sum = 0.0  # of the priorities given so far: a missing one is their mean
        self._priority_count = 0
        self._reorder_at = math.inf  # under sjf: re-sort the queue at this clock time, or once it changes
        self._reorder = False

    def add(self, req: Request) -> None:
        """Queue ``req`` (its ``priority`` orders it under ``sjf``)."""
        if req.priority is None:
            priority = default_priority(self._priority_sum, self._priority_count)
        else:
            priority = req.priority
            self._priority_sum += priority
            self._priority_count += 1
        self._queued[req] = Queued(
            req,
            next(self._arrivals),
            self.clock(),
            priority,
            latency_critical=req.latency_cap is not None,
            tenant=req.tenant or "",
        )
        self.waiting.append(req)
        self._reorder = True

    def remove(self, req: Request) -> None:
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)  # the order of the others stands: no re-sort
            del self._queued[req]

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def pending_prefill_tokens(self) -> int:
        """Tokens to compute before the requests here sample anything (their prompts' rest)."""
        return sum(r.context.num_pending for r in (*self.waiting, *self.running) if not r.decoding)

    @property
    def running_tokens(self) -> int:
        """The running requests' reservations (`reserved_tokens`), which the token caps bound."""
        return sum(reserved_tokens(r) for r in self.running)

    def schedule(self) -> list[ScheduledChunk]:
        budget = self.max_num_batched_tokens
        batch: list[ScheduledChunk] = []
        scheduled: set[int] = set()
        order = sorted(self.running, key=lambda r: (r.context.num_pending > 1, r.request_id))
        for req in order:
            if req not in self.running:  # preempted earlier in this loop
                continue
            n = self._fit(req, min(req.context.num_pending, budget), scheduled, preempt=True)
            if n is None:
                continue
            budget -= n
            scheduled.add(req.request_id)
            batch.append(ScheduledChunk(req, n))
        running_tokens = self.running_tokens
        self._order_waiting()
        while self.waiting and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            reserved = reserved_tokens(req)
            if not self._within_caps(running_tokens + reserved, req):
                break  # FIFO: nothing overtakes a head that does not fit
            n = self._fit(req, min(req.context.num_pending, budget), scheduled, preempt=False)
            if n is None:
                break
            self.waiting.popleft()
            del self._queued[req]
            self.running.append(req)
            running_tokens += reserved
            budget -= n
            scheduled.add(req.request_id)
            batch.append(ScheduledChunk(req, n))
        return batch

    def _order_waiting(self) -> None:
        """Sort the waiting queue into the policy's order, tenants taking turns, when it may have changed:
        something was queued or requeued, or (under sjf) a request reached the aging time. Under fcfs a
        queue of one tenant is already in order."""
        now = self.clock()
        if not self._reorder and now < self._reorder_at:
            return
        self._reorder = False
        queue = [self._queued[r] for r in self.waiting]
        if self.scheduling == "fcfs" and len({e.tenant for e in queue}) <= 1:
            return
        self.waiting = deque(e.item for e in order_waiting(queue, now, self.scheduling, self.sjf_aging_s))
        if self.scheduling == "sjf":
            self._reorder_at = next_reorder_at(queue, now, self.sjf_aging_s)

    def _within_caps(self, total: int, head: Request) -> bool:
        """Whether the running reservations would stay within every token cap with ``head`` admitted
        (``total`` includes it). Nothing running: always (a request larger than a cap runs alone)."""
        if not self.running:
            return True
        caps = [r.latency_cap for r in self.running if r.latency_cap is not None]
        caps += [c for c in (self.max_running_tokens, head.latency_cap) if c is not None]
        return all(total <= cap for cap in caps)

    def _fit(self, req: Request, n: int, scheduled: set[int], preempt: bool) -> int | None:
        """Reserve KV for up to ``n`` tokens of ``req``; return how many fit, or None to skip it this step."""
        ctx = req.context
        if ctx.num_pending == 0:
            return 0  # a generate sampling from the stored hidden state needs neither budget nor blocks
        if n == 0:
            return None  # token budget spent
        while True:
            fits = self._largest_fit(req, n)
            if fits == n or (fits > 0 and not req.decoding):
                self.table.reserve(ctx, fits)
                return fits
            if self._evict_idle():
                continue
            if not (preempt and self._preempt_newest(req, scheduled)):
                return None

    def _largest_fit(self, req: Request, n: int) -> int:
        free = self.table.allocator.num_free
        ctx = req.context
        if self.table.blocks_needed(ctx, n) <= free:
            return n
        lo, hi = 0, n  # blocks_needed grows with the token count: binary search the largest that fits
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.table.blocks_needed(ctx, mid) <= free:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def make_room(self, blocks: int, keep: tuple[Context, ...] = ()) -> bool:
        """Evict idle contexts' KV (as a step does) until ``blocks`` blocks are free, sparing ``keep``;
        whether they are."""
        while self.table.allocator.num_free < blocks:
            if not self._evict_idle(keep):
                return False
        return True

    def _evict_idle(self, keep: tuple[Context, ...] = ()) -> bool:
        """Drop the KV of one context no running request uses (idle, or owned by a waiting request).

        Private blocks go first; only when none is left do whole contexts go, shared blocks included (a
        block shared by two idle contexts comes back once both let go of it).
        """
        running = {id(r.context) for r in self.running} | {id(c) for c in keep}
        idle = [c for c in self.table if id(c) not in running and c.block_table]
        if not idle:
            return False
        private = [c for c in idle if self.table.reclaimable(c) > 0]
        victim = min(private or idle, key=lambda c: c.last_used)
        self.table.evict(victim, keep_shared=bool(private))
        self.num_evictions += 1
        return True

    def _preempt_newest(self, req: Request, scheduled: set[int]) -> bool:
        victims = [
            r
            for r in self.running
            if r is not req and r.request_id not in scheduled and self.table.reclaimable(r.context) > 0
        ]
        if not victims:
            return False
        victim = max(victims, key=lambda r: r.request_id)
        self.table.evict(victim.context)
        victim.decoding = False
        self.running.remove(victim)
        self.waiting.appendleft(victim)
        self._queued[victim] = Queued(victim, next(self._arrivals), self.clock(), 0.0, resumed=True)
        self._reorder = True
        self.num_preemptions += 1
        return True
