"""The cluster scheduler: which engine runs each queued step. A pure function (Algorithm 1 of the paper).

``schedule(queue, engines)`` takes a snapshot of the queued requests and of the engines and returns the
assignments; it does no I/O and reads no clock, so the manager and the simulator (`server.sim`) drive the
very same decisions.

Order: tenants take turns, and within a tenant its apps (`fair_ranks`: one tenant's flood of queued steps
never holds back another's next step); within an app, and between equal turns, requests that have waited
``aging_rounds`` scheduling rounds first (no starvation), then by topological depth (an app's earlier
stages first), then by priority (an OpenAI request's predicted output length: SSJF), then by arrival
(FIFO). For each request, the first branch that applies places it:

1. **pinned** — a later step of a multi-step call continues its call's context: its engine only.
2. **task_group** — the parallel steps feeding one consumer (`server.serve.deduction`) go to one engine
   together (the consumer waits for the slowest: one big batch beats spreading them out).
3. **queue_prefix** — queued requests whose prompts start with the same constant prefix go to one engine
   together, so the prefix is prefilled once and decoded with the shared-prefix kernel.
4. **context** — an engine already holding a context whose tokens prefix the request's: the one holding the
   most tokens, if its cap allows.
5. **find_engine** — otherwise the engine that meets the request's objective with the least impact: for
   latency work the least loaded engine (fastest iterations); for throughput work the least loaded engine
   that runs no latency-bound work (latency engines left alone; concurrent jobs spread over the rest
   rather than piling onto one engine, where their prefills would run one after another).

A prefix batch (3.) that no context serves yet prefers an engine running a request of its prefix (its fill
is under way there: our prefix store, or an OpenAI backend's own prefix cache, will hold it), so a batch
that queued while its first member was being placed still meets it. Lone requests keep load-based
placement on our engines: following the running prefix for them too (even as a tie-break within 256
tokens of load) left each of four GPTs apps with one engine holding its prompt, which the context branch
then keeps it on (`gpts_cluster`: 0.71x the rate of load-only placement at 4 apps). On a cache-routed
engine (an OpenAI backend, whose prefix cache is its only sharing) a lone request follows its running
prefix unless that engine is far busier (``prefix_slack_tokens`` and 1.5x), as cache-aware routers do:
the stragglers of a burst whose first request was placed alone then meet it.

Caps: an engine runs at most ``capacity`` tokens (prompt + new tokens of what it runs); while it runs
latency-bound work, at most ``latency_cap``. A request never goes where its cap would be exceeded: a
latency-bound request only to an engine whose running tokens stay under the latency cap, any request to
an engine running latency-bound work only under that cap. Latency-bound means latency-critical and in no
task group: a group's latency is its slowest member's, which one big batch at full capacity shortens, so a
latency-critical group is placed like latency work (least loaded engine) but capped like throughput work.
A group or prefix batch that fits nowhere as a whole is placed member by member. Ties go to the lowest
engine id. A request larger than every engine's cap is ``unfit`` (the caller fails it: waiting would never
help). When an aged request fits nowhere, nothing after it is placed this round, so the engines drain for
it.
"""

from __future__ import annotations

import itertools
import sys
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from parrot.protocol import Criteria

__all__ = ["Decision", "EngineState", "QueuedRequest", "Reason", "SchedulerConfig", "fair_ranks", "schedule"]

Reason = Literal["pinned", "task_group", "queue_prefix", "context", "find_engine"]


@dataclass(frozen=True)
class QueuedRequest:
    """A step waiting for an engine.

    ``tokens``: what it adds to an engine's running tokens (prompt + max new tokens). ``task_group``: its
    group within its app (None: none). ``shared_prefix``: a key of its prompt's leading constant text (equal
    keys: same prefix), or None. ``cached``: engine id -> how many of its prompt tokens a context on that
    engine already holds. ``pinned``: the only engine it may run on. ``model``: None for any. ``waited``:
    scheduling rounds it has already waited. ``tenant``: who sent it (an API key's tenant, else a client
    address), the unit of fair share. ``priority``: its predicted output length (SSJF) or the client's own
    priority, lower first among requests otherwise equal (None: 0).
    """

    key: str
    app: str
    seq: int
    tokens: int
    criteria: Criteria | None = None
    task_group: str | None = None
    depth: int = 0
    shared_prefix: str | None = None
    cached: Mapping[int, int] = field(default_factory=dict)
    pinned: int | None = None
    model: str | None = None
    waited: int = 0
    tenant: str = ""
    priority: float | None = None

    @property
    def latency_bound(self) -> bool:
        """Whether it holds its engine to the latency cap: latency-critical and in no task group (a group
        is judged by when its slowest member ends, which the bigger batches of the full capacity bring
        sooner — the paper's map stage)."""
        return self.criteria == "latency" and self.task_group is None


@dataclass(frozen=True)
class EngineState:
    """An engine as the scheduler sees it: its caps and what runs there now."""

    engine_id: int
    capacity: int
    latency_cap: int
    running: int = 0
    latency_running: bool = False
    model: str = ""
    # Shared-prefix keys of requests placed here and not finished: the engine has that prefix (or will
    # have it first), in our engine's prefix store or an OpenAI backend's own prefix cache.
    prefixes: frozenset[str] = frozenset()
    # Its only KV sharing is its own prefix cache (an OpenAI backend): a request alone follows a prefix
    # running here too, as a cache-aware router's would, unless this engine is far busier (`_balanced`).
    cache_routed: bool = False
    # Requests placed here and not finished, and the most it takes at once (None: no count cap). Beyond it
    # requests wait in the manager's queue, where tenants take turns, not in the engine's.
    steps: int = 0
    max_steps: int | None = None

    def cap_for(self, criteria: Criteria | None) -> int:
        """The running-token cap a request with ``criteria`` must respect here."""
        return self.latency_cap if criteria == "latency" or self.latency_running else self.capacity

    def fits(self, tokens: int, criteria: Criteria | None, requests: int = 1) -> bool:
        if self.max_steps is not None and self.steps + requests > self.max_steps:
            return False
        return self.running + tokens <= self.cap_for(criteria)

    def serves(self, model: str | None) -> bool:
        return model is None or model == self.model


@dataclass(frozen=True)
class SchedulerConfig:
    aging_rounds: int = 8  # a request that waited this many rounds is placed before any other
    # A cache-routed engine stops drawing lone requests of its running prefix when it runs this many
    # tokens more than the least loaded engine that fits them, and 1.5 times as many (SGLang's router
    # balances on both conditions likewise).
    prefix_slack_tokens: int = 4096


@dataclass
class Decision:
    """Where each placed request goes (key -> engine id), which branch placed it, and the unfit keys."""

    assignments: dict[str, int] = field(default_factory=dict)
    reasons: dict[str, Reason] = field(default_factory=dict)
    unfit: list[str] = field(default_factory=list)


def schedule(
    queue: Sequence[QueuedRequest], engines: Sequence[EngineState], config: SchedulerConfig | None = None
) -> Decision:
    """Assign queued requests to engines (see the module docstring). Pure: the inputs are not changed."""
    config = config or SchedulerConfig()
    state = {e.engine_id: e for e in engines}
    decision = Decision()
    placed: set[str] = set()

    urgencies = {r.key: (r.waited < config.aging_rounds, r.depth, r.priority or 0.0, r.seq) for r in queue}

    def urgency(r: QueuedRequest) -> tuple[bool, int, float, int]:
        return urgencies[r.key]

    rank = fair_ranks(queue, urgency)
    ordered = sorted(queue, key=lambda r: (rank[r.key], urgencies[r.key]))
    unplaced = Counter(r.tenant for r in queue)  # tenant -> its requests not placed (nor unfit) yet
    for request in ordered:
        if request.key in placed:
            continue
        if _oversized(request, state.values()):
            decision.unfit.append(request.key)
            placed.add(request.key)
            unplaced[request.tenant] -= 1
            continue
        if not any(e.fits(0, None) for e in state.values()):
            continue  # every engine takes its most steps: only the oversized are left to find
        alone: Reason = "pinned" if request.pinned is not None else "find_engine"
        if _place([request], alone, state, config.prefix_slack_tokens)[0] is None:
            # Nothing fits it alone, so no batch with it does either: skip before gathering one (a pass over
            # thousands of queued requests while the engines are full stays linear).
            if request.waited >= config.aging_rounds:
                break  # reserve: let the engines drain for it
            continue
        # A prefix batch leaves a place for each other tenant still waiting: their next turns come first.
        others = sum(1 for t, n in unplaced.items() if n > 0 and t != request.tenant)
        batch, reason = _batch_of(request, ordered, placed, _room(request, state.values()) - others)
        engine, reason = _place(batch, reason, state, config.prefix_slack_tokens)
        if engine is None and len(batch) > 1:  # too big together: each on its own
            batch = [request]
            reason = "context" if request.cached else "find_engine"
            engine, reason = _place(batch, reason, state, config.prefix_slack_tokens)
        if engine is None:
            if request.waited >= config.aging_rounds:
                break  # reserve: let the engines drain for it
            continue
        bound = any(r.latency_bound for r in batch)
        for member in batch:
            decision.assignments[member.key] = engine
            decision.reasons[member.key] = reason
            placed.add(member.key)
            unplaced[member.tenant] -= 1
        current = state[engine]
        keys = {r.shared_prefix for r in batch if r.shared_prefix is not None}
        state[engine] = replace(
            current,
            running=current.running + sum(r.tokens for r in batch),
            steps=current.steps + len(batch),
            latency_running=current.latency_running or bound,
            prefixes=current.prefixes | keys if keys else current.prefixes,
        )
    return decision


def _batch_of(
    request: QueuedRequest, ordered: Sequence[QueuedRequest], placed: set[str], room: int
) -> tuple[list[QueuedRequest], Reason]:
    """The requests placed together with ``request`` and the branch that groups them. A prefix batch takes
    ``request`` and the next sharing requests in order, at most ``room`` in all (the most steps an engine
    still takes): a longer one could not be placed together, and gathering it would cost a pass over the
    whole queue per placement."""
    if request.pinned is not None:
        return [request], "pinned"
    free = (r for r in ordered if r.key not in placed and r.pinned is None and r.model == request.model)
    if request.task_group is not None:
        group = [r for r in free if r.app == request.app and r.task_group == request.task_group]
        return group, "task_group"
    if request.shared_prefix is not None:
        others = (
            r
            for r in free
            if r.shared_prefix == request.shared_prefix and r.task_group is None and r is not request
        )
        sharing = [request, *itertools.islice(others, max(room - 1, 0))]
        if len(sharing) > 1:
            return sharing, "queue_prefix"
    if any(n > 0 for n in request.cached.values()):
        return [request], "context"
    return [request], "find_engine"


def _room(request: QueuedRequest, engines: Iterable[EngineState]) -> int:
    """The most steps one engine serving ``request``'s model still takes (no count cap: unbounded)."""
    return max(
        (
            sys.maxsize if e.max_steps is None else e.max_steps - e.steps
            for e in engines
            if e.serves(request.model)
        ),
        default=0,
    )


def _place(
    batch: list[QueuedRequest], reason: Reason, state: Mapping[int, EngineState], slack: int
) -> tuple[int | None, Reason]:
    """The engine for ``batch`` (None when none fits) and the branch that chose it: a request whose
    context holder is full falls through to find_engine."""
    tokens = sum(r.tokens for r in batch)
    criteria = _strictest(r.criteria for r in batch)
    cap: Criteria | None = "latency" if any(r.latency_bound for r in batch) else None
    if reason == "pinned":
        pinned = state.get(batch[0].pinned)  # type: ignore[arg-type]
        fits = pinned is not None and pinned.fits(tokens, cap, len(batch))
        return (pinned.engine_id if fits and pinned is not None else None), reason
    fitting = [e for e in state.values() if e.serves(batch[0].model) and e.fits(tokens, cap, len(batch))]
    if not fitting:
        return None, reason
    # Groups and prefix batches prefer an engine holding their prefix too; then find_engine's rule.
    cached = {e.engine_id: max((r.cached.get(e.engine_id, 0) for r in batch), default=0) for e in fitting}
    best = max(cached.values())
    # A prefix batch follows an engine already running its prefix; a lone request only a cache-routed one
    # (on our engines, placing lone requests by load keeps engines balanced when a few apps' prompts
    # differ in cost, and each engine then holds its own copy of a hot prefix).
    key = batch[0].shared_prefix if reason != "task_group" else None
    running_it = [e for e in fitting if key is not None and key in e.prefixes]
    if running_it and reason != "queue_prefix":
        least = min(e.running for e in fitting)
        running_it = [e for e in running_it if e.cache_routed and _balanced(e, least, slack)]
    if best > 0 and reason != "find_engine":
        fitting = [e for e in fitting if cached[e.engine_id] == best]
    elif running_it:  # no context holds it yet, but an engine runs a request of that prefix
        fitting = running_it
        reason = "context" if reason == "find_engine" else reason
    elif reason == "context":
        reason = "find_engine"
    return _find_engine(fitting, criteria), reason


def _balanced(e: EngineState, least: int, slack: int) -> bool:
    """Whether ``e`` is not far busier than the least loaded engine (``least`` running tokens): imbalanced
    only past both ``slack`` more tokens and 1.5 times as many."""
    return e.running - least <= slack or e.running <= 1.5 * least


def _find_engine(fitting: list[EngineState], criteria: Criteria | None) -> int:
    if criteria == "latency":
        return min(fitting, key=lambda e: (e.running, e.engine_id)).engine_id
    # Throughput: keep off engines running latency-bound work, then the least loaded.
    return min(fitting, key=lambda e: (e.latency_running, e.running, e.engine_id)).engine_id


def fair_ranks(queue: Sequence[QueuedRequest], urgency: Callable[[QueuedRequest], Any]) -> dict[str, int]:
    """Each request's turn in a round robin over tenants, and within a tenant over its apps: a tenant's
    k-th request (its apps taking turns, each app's requests in ``urgency`` order) comes before any
    tenant's (k+1)-th, so a tenant's flood of queued steps never holds back another tenant's next one. With
    one tenant and one app the turns are the ``urgency`` order itself."""
    by_app: dict[tuple[str, str], list[QueuedRequest]] = {}
    for r in queue:
        by_app.setdefault((r.tenant, r.app), []).append(r)
    app_turn: dict[str, int] = {}
    for requests in by_app.values():
        for turn, r in enumerate(sorted(requests, key=urgency)):
            app_turn[r.key] = turn
    by_tenant: dict[str, list[QueuedRequest]] = {}
    for r in queue:
        by_tenant.setdefault(r.tenant, []).append(r)
    rank: dict[str, int] = {}
    for requests in by_tenant.values():
        for turn, r in enumerate(sorted(requests, key=lambda r: (app_turn[r.key], urgency(r)))):
            rank[r.key] = turn
    return rank


def _oversized(request: QueuedRequest, engines: Iterable[EngineState]) -> bool:
    if request.pinned is not None:
        engines = [e for e in engines if e.engine_id == request.pinned]
    caps = [
        e.latency_cap if request.latency_bound else e.capacity for e in engines if e.serves(request.model)
    ]
    return not caps or request.tokens > max(caps)


def _strictest(criteria: Iterable[Criteria | None]) -> Criteria | None:
    values = set(criteria)
    if "latency" in values:
        return "latency"
    return "throughput" if "throughput" in values else None
