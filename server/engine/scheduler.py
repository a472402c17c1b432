"""Forms each engine step: which requests run and how many of their pending tokens, under the budgets.

Order of service: running decodes first (one token each, latency), then running fills chunked to the token
budget, then waiting requests admitted FIFO while the running-sequence cap allows. When KV blocks run short,
room is made by evicting idle contexts' private KV (least recently used first), then — for running work
only — by preempting the newest running request (its KV is dropped and recomputed later; its tokens are
kept, so nothing is lost). New work never preempts running work: it waits.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from server.engine.context import ContextTable
from server.engine.request import Request


@dataclass(frozen=True)
class ScheduledChunk:
    """``num_tokens`` pending tokens of ``request``'s context run this step (0: sample from stored state)."""

    request: Request
    num_tokens: int


class Scheduler:
    def __init__(self, table: ContextTable, max_num_batched_tokens: int, max_num_seqs: int) -> None:
        self.table = table
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.num_evictions = 0

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def remove(self, req: Request) -> None:
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

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
        while self.waiting and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            n = self._fit(req, min(req.context.num_pending, budget), scheduled, preempt=False)
            if n is None:
                break
            self.waiting.popleft()
            self.running.append(req)
            budget -= n
            scheduled.add(req.request_id)
            batch.append(ScheduledChunk(req, n))
        return batch

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

    def _evict_idle(self) -> bool:
        """Drop the KV of one context no running request uses (idle, or owned by a waiting request).

        Private blocks go first; only when none is left do whole contexts go, shared blocks included (a
        block shared by two idle contexts comes back once both let go of it).
        """
        running = {id(r.context) for r in self.running}
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
        self.num_preemptions += 1
        return True
