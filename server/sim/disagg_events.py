"""The discrete-event engine of `server.sim.disagg`: arrivals, KV memory, prompt chunks and steps on a
virtual clock (a heap of timed callbacks, ties in scheduling order: a run is deterministic). The decode side
(hand-offs, decode batches, the end of a turn, link copies) and an instance's state are
`server.sim.disagg_decode`.

What a step costs: the `LatencyModel` terms — base (the weights read once) + per decode sequence + per KV
token read + per prompt token + per prompt query-key pair; a prompt chunk alone pays the base itself.
Mutel's decode step sends each layer's query out before it attends over its own (generated) KV, so the
exchange (`ClusterCost.exchange_s`) and each prefill instance's attention over its prompts (KV reads there)
run beside that local attention: the step takes the longer of the two. The remote attention waits behind
other decode instances' attention on that instance (first come first served, a whole step's worth at a
time: conservative) and for whatever of the prompt chunk under way outlasts the decode step's gap between
two layers' queries; that attention lengthens the prefill instance's chunk. Mutel's prefill instances size
their chunks to that gap (the seed's coordination: decode attention is never blocked).

KV memory: a turn reserves its whole final KV where it will live (colocated: context + answer on one
instance; Splitwise: the context on the prefill instance until sent, context + answer on the decode
instance; Mutel: the context on the prefill instance, the answer on the decode instance), so nothing is
preempted; a turn without room waits, first come first served. Idle conversations' KV stays for the next
turn and is evicted least recently used. The answer length reserved is the true one, for every policy.
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter, deque
from collections.abc import Callable
from typing import Any

from server.cluster import mutel
from server.cluster.mutel import InstanceView, RejectReason, Slo, TurnRequest
from server.sim.disagg_cost import ClusterCost
from server.sim.disagg_decode import DecodeSide, Instance
from server.sim.disagg_types import Policy, SimResult, TurnRecord
from server.sim.disagg_workload import Conversation

__all__ = ["ClusterSim"]


class ClusterSim(DecodeSide):
    """One run of `server.sim.disagg.simulate`."""

    def __init__(
        self,
        policy: Policy,
        slo: Slo,
        conversations: list[Conversation],
        cost: ClusterCost,
        warmup: float,
        drain_s: float,
        stop_on_fail: bool,
    ) -> None:
        self.policy, self.slo, self.cost = policy, slo, cost
        self.mutel, self.colocated = policy.name == "mutel", policy.name == "colocated"
        self.insts = [Instance(i, role, cost.latency.kv_tokens) for i, role in enumerate(policy.roles())]
        self.peer, self.host = cost.costs(host=False), cost.costs(host=True)
        self.conversations = {c.id: c for c in conversations}
        span = max(c.start_s for c in conversations)
        self.window, self.horizon = (warmup * span, span), span + drain_s
        self.miss_limit = 0.1 * sum(len(c.turns) for c in conversations) if stop_on_fail else float("inf")
        self.misses = [0, 0]  # measured turns past the TTFT SLO, past the TPOT SLO
        self.events: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        self.seq = itertools.count()
        self.now, self.aborted = 0.0, False
        self.records: list[TurnRecord] = []
        self.dwait: deque[TurnRecord] = deque()  # prefilled turns waiting for a decode instance with room
        self.moved: Counter[str] = Counter()
        for c in conversations:
            self.at(c.start_s, self.arrive, c, 0, 0)

    def at(self, t: float, fn: Callable[..., None], *args: Any) -> None:
        heapq.heappush(self.events, (t, next(self.seq), fn, args))

    def run(self) -> SimResult:
        while self.events and not self.aborted:
            t, _, fn, args = heapq.heappop(self.events)
            if t > self.horizon:
                break
            self.now = t
            fn(*args)
        peaks = tuple(i.peak for i in self.insts)
        capacity = self.insts[0].capacity
        return SimResult(self.policy, self.slo, tuple(self.records), dict(self.moved), peaks, capacity,
                         self.aborted, self.now)  # fmt: skip

    def view(self, i: Instance) -> InstanceView:
        decodes, step = len(i.batch) + len(i.joining), i.step_s if i.batch else 0.0
        waiting = i.mem_wait[0].context_tokens if i.mem_wait else 0
        return InstanceView(i.index, i.role, i.capacity, i.used, i.backlog, decodes, step, i.per_token_s,
                            i.cache, waiting)  # fmt: skip

    def miss(self, r: TurnRecord, which: tuple[int, ...]) -> None:
        if r.measured:
            for k in which:
                self.misses[k] += 1
            self.aborted = max(self.misses) > self.miss_limit

    # ------------------------------------------------------------------------------------------ arrival
    def arrive(self, conv: Conversation, k: int, history: int) -> None:
        turn, (lo, hi) = conv.turns[k], self.window
        r = TurnRecord(len(self.records), conv.id, k, self.now, history, turn.prompt_tokens,
                       turn.output_tokens, lo <= self.now <= hi)  # fmt: skip
        self.records.append(r)
        req = TurnRequest(conv.id, k, r.prompt_tokens, history, r.output_tokens)
        views = [self.view(i) for i in self.insts]
        locality = self.policy.reuse_kv and self.policy.name != "splitwise"
        choice = mutel.choose_prefill(views, req, self.host, locality, self.slo)
        if choice is None:
            r.rejected = RejectReason.NO_CAPACITY
        elif self.policy.admission:
            on_decode = r.output_tokens + (0 if self.mutel else r.context_tokens)
            d = choice.instance if self.colocated else mutel.choose_decode(views, on_decode)
            local = r.output_tokens // 2 + (0 if self.mutel else r.context_tokens)
            remote = r.context_tokens if self.mutel else 0
            decode = None if d is None else views[d]
            rejection = mutel.admit(choice, decode, self.slo, self.peer, local, remote, overlapped=self.mutel)
            r.rejected = rejection.reason if rejection else None
        if choice is None or r.rejected:
            self.miss(r, (0, 1))
            return
        p = self.insts[choice.instance]
        for other in self.insts:  # its KV elsewhere is stale now: this turn's instance will hold the newest
            if other is not p:
                other.drop(conv.id)
        r.prefill, r.todo = p.index, choice.compute_tokens
        p.backlog += r.todo
        p.mem_wait.append(r)
        self.try_start(p)

    def try_start(self, p: Instance) -> None:
        """Start the turns waiting for KV room on ``p``, in order: reuse what it holds, fetch the rest."""
        while p.mem_wait:
            r = p.mem_wait[0]
            held = min(p.drop(r.conversation), r.history_tokens)
            reserve = r.context_tokens + (r.output_tokens if self.colocated else 0)
            if not p.make_room(reserve):  # (the held KV, out of the cache now, is part of ``reserve``)
                if held:
                    p.keep(r.conversation, held)
                return
            p.mem_wait.popleft()
            p.reserve(reserve)
            missing, host = r.history_tokens - held, self.host
            fetch = "recompute"
            if self.policy.reuse_kv:  # else nothing of earlier turns is kept anywhere
                fetch = mutel.move_or_recompute(missing, host.kv_bytes_per_token, host.link_bytes_per_s,
                                          host.prefill_token_s, host.link_latency_s)  # fmt: skip
            todo = r.prompt_tokens + (missing if fetch == "recompute" else 0)
            p.backlog += todo - r.todo
            r.todo, r.cached = todo, r.context_tokens - todo
            if fetch == "move":
                self.at(self.transfer(None, p, missing, "history_load"), self.enqueue, p, r)
            else:
                self.enqueue(p, r)

    def enqueue(self, p: Instance, r: TurnRecord) -> None:
        p.queue.append(r)
        self.kick(p)

    def kick(self, i: Instance) -> None:
        if not i.busy:
            self.step(i)

    # ------------------------------------------------------------------------------------------ steps
    def chunk(self, i: Instance, decode_s: float) -> tuple[list[tuple[TurnRecord, int]], float]:
        """This step's prompt tokens (from the queue's head on), sized to the TPOT budget of the decodes
        that wait on them; and their compute time."""
        if not i.queue:
            return [], 0.0
        pol, budget = self.policy, {"min_tokens": self.policy.min_chunk, "max_tokens": self.policy.max_chunk}
        budget["cached_tokens"] = i.queue[0].cached
        n = pol.max_chunk
        if pol.chunked and self.colocated:
            n = mutel.chunk_size(self.slo.tpot_s, decode_s, self.peer, **budget)
        elif pol.chunked and self.mutel:  # each layer of the chunk ends before the next query comes
            gaps = [self.gap_s(d) for d in self.insts if d.remote[i.index] > 0 and d.batch]
            if gaps:
                n = mutel.chunk_within(min(gaps), self.peer, fixed_s=self.cost.latency.base, **budget)
        parts, seconds = [], 0.0
        for r in i.queue:
            if n <= 0:
                break
            k = min(r.todo, n)
            parts.append((r, k))
            seconds += self.peer.prefill_s(k, r.cached)
            n -= k
        return parts, seconds

    def step(self, i: Instance) -> None:
        while i.joining and len(i.batch) < self.policy.max_num_seqs:
            self.join(i, i.joining.popleft())
        decode_s = 0.0
        if i.batch:
            n = len(i.batch)
            decode_s = self.cost.decode_s(n, i.local_kv)
            if self.mutel:  # the remote part (exchange, attention there) runs beside the local attention
                self.moved["exchange"] += self.cost.exchange_bytes(n)
                remote_s = self.cost.exchange_s(n) + self.remote_attention(i)
                decode_s += max(0.0, remote_s - self.cost.latency.kv_token * i.local_kv)
        parts, prefill_s = self.chunk(i, decode_s)
        if not parts and not i.batch:
            i.busy, i.chunk_s = False, 0.0
            return
        attention_s = 0.0
        if not i.batch:  # a chunk alone reads the weights itself, after the attention it is serving
            prefill_s += self.cost.latency.base
            attention_s = max(0.0, i.attn_free - self.now)
            i.stolen = 0.0  # (that attention, counted once: the chunk waits for it to end)
        i.busy, i.chunk_s = True, 0.0 if i.batch else prefill_s
        total = decode_s + prefill_s + attention_s
        if (
            i.batch
        ):  # a TPOT averages a turn's hundreds of steps: the estimate, the last ~50 (a second or two)
            i.step_s = total if not i.step_s else 0.98 * i.step_s + 0.02 * total
        self.at(self.now + total, self.step_done, i, parts, bool(i.batch), self.now)

    def gap_s(self, d: Instance) -> float:
        """Mutel: a decode step's time between two layers' attention requests (summed over the layers): its
        dense compute and the exchange's link time."""
        m, n = self.cost.latency, len(d.batch)
        return m.base + m.decode_seq * n + self.cost.exchange_s(n)

    def remote_attention(self, d: Instance) -> float:
        """Mutel: every prefill instance's attention for ``d``'s step; how long ``d`` waits for them all
        (excluding the exchange). Each waits behind other decode instances' attention there (first come
        first served, a whole step's worth at a time: conservative) and, per layer, for the part of that
        layer of the chunk under way that outlasts ``d``'s gap between queries (`gap_s`): nothing when the
        chunk was sized to the gap (`chunk`), a chunk's worth when it was started with nothing waiting."""
        wait, gap = 0.0, self.gap_s(d)
        for pi, tokens in d.remote.items():
            if tokens <= 0:
                continue
            p, work = self.insts[pi], self.cost.latency.kv_token * tokens
            begin = max(self.now, p.attn_free)
            p.attn_free = begin + work
            stall = max(0.0, p.chunk_s - gap) if p.busy else 0.0
            if p.busy:
                p.stolen += work
            wait = max(wait, begin - self.now + stall + work)
        return wait

    def step_done(
        self, i: Instance, parts: list[tuple[TurnRecord, int]], decoded: bool, started: float
    ) -> None:
        if i.stolen > 0:  # attention served meanwhile: the chunk ends that much later
            self.at(self.now + i.stolen, self.step_done, i, parts, decoded, started)
            i.stolen = 0.0
            return
        if decoded:
            i.steps += 1
            i.local_kv += len(i.batch)
            while i.batch and i.batch[0][0] <= i.steps:
                self.finish(i, heapq.heappop(i.batch)[2])
        tokens = sum(k for _, k in parts)
        for r, k in parts:
            r.todo -= k
            r.cached += k
        i.backlog -= tokens
        i.chunk_s = 0.0  # the chunk is over: decode steps the hand-offs below start do not wait for it
        if tokens:
            sample = (self.now - started) / tokens
            i.per_token_s = sample if not i.per_token_s else 0.7 * i.per_token_s + 0.3 * sample
        while i.queue and i.queue[0].todo == 0:
            self.prefill_done(i, i.queue.popleft())
        self.step(i)
