"""Open-loop runs on the simulator: requests sent at their arrival times, on virtual time, to a cluster.

An application experiment times one job (`measure`); a cluster experiment offers a stream of requests
(`arrivals`) and asks how the system copes, each request timed from its arrival to its answer. Here are
the parts such experiments share on `server.sim` (virtual seconds of a latency model):

* `simulated`: a `System` on simulated engines with a given latency model, as a `SimServed` that also
  reports what its cluster did (`Work`: the engines' counters and busy time, where the scheduler placed
  steps and why);
* `open_loop`: calls started at their arrival times on virtual time, each one's latency;
* `MemoTokenizer`: the engines' tokenizer with its answers remembered across runs (wall time only).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from array import array
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from benchmarks.harness.arrivals import paced
from benchmarks.harness.systems import Served, System

__all__ = ["Call", "MemoTokenizer", "SimServed", "Work", "memo_tokenizer", "open_loop", "simulated"]

Call = Callable[[], Awaitable[Any]]


@dataclass
class Work:
    """What a simulated cluster did in one run: seconds (simulated, and wall for the report), each
    engine's counters (`EngineStats` plus ``busy_s``) and Parrot's placements ("engine/branch": steps)."""

    virtual_s: float
    wall_s: float
    engines: list[dict[str, Any]] = field(default_factory=list)
    placements: dict[str, int] = field(default_factory=dict)

    def placed_by(self) -> Counter[str]:
        """Steps placed per scheduler branch, over all engines."""
        out: Counter[str] = Counter()
        for key, n in self.placements.items():
            out[key.split("/", 1)[1]] += n
        return out


@dataclass
class SimServed(Served):
    """A `Served` on the simulator that also knows its manager and when it started."""

    manager: Any = None
    started: float = 0.0  # virtual seconds
    wall_started: float = 0.0

    def now(self) -> float:
        """Simulated seconds on the running virtual-time loop."""
        return asyncio.get_running_loop().time()

    def work(self) -> Work:
        """The cluster's work since it started."""
        engines = [e.stats().model_dump() | {"busy_s": e.busy_seconds} for e in self.engines]
        placed = sorted(self.manager.placement.placed.items())
        return Work(
            virtual_s=self.now() - self.started,
            wall_s=time.perf_counter() - self.wall_started,
            engines=engines,
            placements={f"{e}/{reason}": n for (e, reason), n in placed},
        )


@contextlib.asynccontextmanager
async def simulated(system: System, latency: Any, *, memo: bool = False) -> AsyncIterator[SimServed]:
    """``system`` on simulated engines timed by the `server.sim.LatencyModel` ``latency`` (run inside
    `server.sim.run`); ``memo``: the engines share this process's `MemoTokenizer`."""
    from server.sim import sim_cluster

    async with sim_cluster(
        system.engines, latency, engine_config=system.engine, manager_config=system.manager
    ) as cluster:
        if memo:
            for engine in cluster.engines:
                engine.tokenizer = memo_tokenizer(engine.tokenizer)
        yield SimServed(
            system,
            cluster.url,
            cluster.engines,
            client=cluster.client,
            manager=cluster.manager,
            started=cluster.now(),
            wall_started=time.perf_counter(),
        )


async def open_loop(
    served: SimServed,
    calls: Iterable[tuple[float, Call]],
    on_error: Callable[[Exception], None] | None = None,
) -> list[float | None]:
    """Each ``(arrival, call)`` started ``arrival`` simulated seconds after ``served`` started, all
    concurrently; each one's seconds from its start to its return. A call that raises stops the run,
    unless ``on_error`` is given: it gets the error and the call's latency is None."""

    async def timed(call: Call) -> float | None:
        start = served.now()
        try:
            await call()
        except Exception as e:
            if on_error is None:
                raise
            on_error(e)
            return None
        return served.now() - start

    return await paced(
        [(at, functools.partial(timed, call)) for at, call in calls], served.started, served.now
    )


class MemoTokenizer:
    """A tokenizer whose ``encode`` remembers its answers (the same ids; all else passes through).

    Tokenizing takes no simulated time, but wall time it does: the manager encodes every prompt whole,
    and a shared prefix again for every call. Where the same prompts recur run after run (one workload at
    several rates), one memo per process encodes each text once. Ids are kept as int32 arrays.
    """

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self._memo: dict[tuple[str, bool], array[int]] = {}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        key = (text, add_special_tokens)
        ids = self._memo.get(key)
        if ids is None:
            ids = self._memo[key] = array(
                "i", self._inner.encode(text, add_special_tokens=add_special_tokens)
            )
        return ids.tolist()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


_MEMOS: dict[int, MemoTokenizer] = {}


def memo_tokenizer(inner: Any) -> MemoTokenizer:
    """The one `MemoTokenizer` of ``inner`` in this process."""
    if id(inner) not in _MEMOS:
        _MEMOS[id(inner)] = MemoTokenizer(inner)
    return _MEMOS[id(inner)]
