"""An instance's state, and the decode side of `server.sim.disagg_events.ClusterSim`: a prefilled turn's
hand-off to a decode instance, its decode batch, the end of the turn (what KV stays where) and bulk KV
copies over the link.

Link: each instance's port is full duplex; a bulk copy occupies the sender's outgoing and the receiver's
incoming port, first come first served (host memory itself is never the bottleneck). Mutel's per-step
exchange has priority on the link and does not slow bulk copies (it is under a megabyte per request-step).
"""

from __future__ import annotations

import heapq
from collections import Counter, OrderedDict, defaultdict, deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from server.cluster.mutel import (
    CostModel,
    Role,
    Slo,
    TurnRequest,
    balance_kv,
    choose_decode,
    move_or_recompute,
)
from server.sim.disagg_cost import ClusterCost
from server.sim.disagg_types import Policy, TurnRecord

if TYPE_CHECKING:
    from server.cluster.mutel import InstanceView
    from server.sim.disagg_workload import Conversation

__all__ = ["DecodeSide", "Instance"]


class Instance:
    """One GPU: its KV memory, prompt queue, decode batch and link ports."""

    def __init__(self, index: int, role: Role, capacity: int) -> None:
        self.index, self.role, self.capacity = index, role, capacity
        self.used = 0  # KV reserved by turns in flight
        self.cache: OrderedDict[int, int] = OrderedDict()  # idle conversation -> its KV here, LRU first
        self.cached = self.peak = 0
        self.mem_wait: deque[TurnRecord] = deque()  # turns waiting for KV room to start their prefill
        self.queue: deque[TurnRecord] = deque()  # prompts ready to compute
        self.backlog = 0  # prompt tokens waiting or queued here
        self.joining: deque[TurnRecord] = deque()
        self.batch: list[tuple[int, int, TurnRecord]] = []  # heap of (its last step, id, turn) decoding here
        self.steps = self.local_kv = 0
        self.remote: Counter[int] = Counter()  # Mutel: prefill instance -> prompt KV attended there per step
        self.busy, self.chunk_s, self.stolen, self.attn_free = False, 0.0, 0.0, 0.0
        self.step_s = self.per_token_s = 0.0  # smoothed decode step; prefill seconds per token
        self.ports: defaultdict[str, float] = defaultdict(float)  # port -> busy until

    def keep(self, conversation: int, tokens: int) -> None:
        self.cache[conversation] = tokens
        self.cached += tokens
        self.peak = max(self.peak, self.used + self.cached)

    def drop(self, conversation: int) -> int:
        tokens = self.cache.pop(conversation, 0)
        self.cached -= tokens
        return tokens

    def make_room(self, tokens: int) -> bool:
        """Evict idle conversations, least recently used first, until ``tokens`` are free."""
        while self.capacity - self.used - self.cached < tokens and self.cache:
            self.drop(next(iter(self.cache)))
        return self.capacity - self.used - self.cached >= tokens

    def reserve(self, tokens: int) -> None:
        self.used += tokens
        self.peak = max(self.peak, self.used + self.cached)


class DecodeSide:
    """Decode-side events; the state is `ClusterSim`'s."""

    policy: Policy
    slo: Slo
    cost: ClusterCost
    peer: CostModel
    mutel: bool
    colocated: bool
    now: float
    insts: list[Instance]
    dwait: deque[TurnRecord]
    moved: Counter[str]
    conversations: dict[int, Conversation]
    at: Callable[..., None]
    kick: Callable[[Instance], None]
    try_start: Callable[[Instance], None]
    view: Callable[[Instance], InstanceView]
    miss: Callable[[TurnRecord, tuple[int, ...]], None]
    arrive: Callable[..., None]

    def prefill_done(self, p: Instance, r: TurnRecord) -> None:
        r.first_s = self.now
        if r.ttft_s > self.slo.ttft_s:
            self.miss(r, (0,))
        r.context_on_decode = not self.mutel
        if self.colocated:
            r.decode = p.index
            p.joining.append(r)
        else:
            self.dwait.append(r)
            self.dispatch()

    def dispatch(self) -> None:
        """Prefilled turns, in order, to the least loaded decode instance with room for their KV there."""
        while self.dwait:
            r = self.dwait[0]
            views = [self.view(i) for i in self.insts]
            if self.mutel:
                req = TurnRequest(r.conversation, r.turn, r.prompt_tokens, r.history_tokens, r.output_tokens)
                moved = balance_kv(views[r.prefill], views, req)
                r.context_on_decode = moved is not None
                d = moved if moved is not None else choose_decode(views, r.output_tokens)
            else:
                d = choose_decode(views, r.output_tokens + r.context_tokens)
            if d is None:
                return
            self.dwait.popleft()
            r.decode = d
            self.insts[d].reserve(r.output_tokens + (r.context_tokens if r.context_on_decode else 0))
            if not r.context_on_decode:  # Mutel: the prompt's KV stays where it is
                self.handoff(r)
            else:
                end = self.transfer(self.insts[r.prefill], self.insts[d], r.context_tokens, "kv_to_decode")
                self.at(end, self.handoff, r)

    def handoff(self, r: TurnRecord) -> None:
        if (
            r.context_on_decode
        ):  # the whole context is on the decode instance now: the prefill instance drops it
            p = self.insts[r.prefill]
            p.used -= r.context_tokens
            self.try_start(p)
        d = self.insts[r.decode]
        d.joining.append(r)
        self.kick(d)

    def join(self, d: Instance, r: TurnRecord) -> None:
        r.local0, r.join_step = (r.context_tokens if r.context_on_decode else 0), d.steps
        d.local_kv += r.local0
        if not r.context_on_decode:
            d.remote[r.prefill] += r.context_tokens
        heapq.heappush(d.batch, (d.steps + r.output_tokens - 1, r.id, r))

    def finish(self, d: Instance, r: TurnRecord) -> None:
        """The turn's last token: free its KV, keep what the next turn reuses, and schedule that turn."""
        r.done_s = self.now
        if r.tpot_s > self.slo.tpot_s:
            self.miss(r, (1,))
        p, ctx, out = self.insts[r.prefill], r.context_tokens, r.output_tokens
        d.local_kv -= r.local0 + d.steps - r.join_step
        d.used -= out + (ctx if r.context_on_decode else 0)
        if not r.context_on_decode:
            d.remote[r.prefill] -= ctx
            p.used -= ctx
        if self.policy.reuse_kv:
            # The turn's new KV goes to host memory (the rest is there already); what stays on a GPU:
            # colocated the whole conversation, Splitwise nothing, Mutel the prompts (+ the answer, back).
            if not r.context_on_decode:
                p.keep(r.conversation, ctx)
                self.transfer(p, None, r.prompt_tokens, "host_write")
                self.transfer(d, None, out, "host_write")
                if self.move_back(out):
                    self.at(self.transfer(d, p, out, "kv_back"), self.grow, p, r.conversation, ctx, out)
            else:
                if self.colocated:
                    p.keep(r.conversation, ctx + out)
                self.transfer(d, None, r.prompt_tokens + out, "host_write")
        self.dispatch()
        self.try_start(p)
        conv = self.conversations[r.conversation]
        if r.turn + 1 < len(conv.turns):  # the user reads, thinks and asks again
            self.at(self.now + conv.turns[r.turn + 1].think_s, self.arrive, conv, r.turn + 1, ctx + out)

    def move_back(self, tokens: int) -> bool:
        peer = self.peer
        return (
            move_or_recompute(
                tokens,
                peer.kv_bytes_per_token,
                peer.link_bytes_per_s,
                peer.prefill_token_s,
                peer.link_latency_s,
            )
            == "move"
        )

    def grow(self, p: Instance, conversation: int, context: int, output: int) -> None:
        """Mutel: the answer's KV is back on the prefill instance, beside its prompt (if that is still
        there and its next turn has not started)."""
        if p.cache.get(conversation) != context:
            return
        p.drop(conversation)
        tokens = context + output if p.make_room(context + output) else context
        if p.make_room(tokens):
            p.keep(conversation, tokens)

    def transfer(self, src: Instance | None, dst: Instance | None, tokens: int, kind: str) -> float:
        """A bulk KV copy between instances (None: host memory); returns when it ends."""
        host = src is None or dst is None
        prefix = "h" if host and not self.cost.link.shared else ""  # host copies on their own wires
        ports = [(i, prefix + way) for i, way in ((src, "out"), (dst, "in")) if i is not None]
        start = max([self.now, *(i.ports[key] for i, key in ports)])
        end = start + self.cost.transfer_s(tokens, host)
        for i, key in ports:
            i.ports[key] = end
        self.moved[kind] += tokens * self.cost.kv_bytes_per_token
        return end
