"""Systems: named server configurations, started on real engines (`serve`) or on the simulator (`simulate`).

A `System` is what one column of a results table ran on — Parrot, a Parrot ablation, the request-centric
baseline with its FIFO latency cap — as an engine and a manager configuration. `serve` starts every system
as its own in-process server (`server.launch`), each behind the simulated client network delay switched off;
`simulate` starts one on simulated engines (`server.sim`) on virtual time. Both hand back `Served`: the
base URL, an HTTP client (real servers: opened by `connected` on the event loop that uses it), the engines'
counters and the delay switch, so one client function drives either.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections import Counter
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

import httpx

from benchmarks.harness.flags import bench_dtype
from kernels import cpu_kernels
from server.common.netdelay import NetworkDelayMiddleware
from server.engine import EngineConfig
from server.engine.config import cpu_has_native_bf16
from server.launcher import LaunchedServer, launch
from server.serve.manager import ManagerConfig

__all__ = [
    "DELAY_S",
    "ENGINE_COUNTERS",
    "Served",
    "System",
    "baseline",
    "comparable",
    "connected",
    "delay_label",
    "delayed",
    "parrot",
    "serve",
    "simulate",
]

DELAY_S = (0.2, 0.3)  # the paper's client network delay, U(0.2, 0.3) s per request


def delay_label(delay: bool) -> str:
    """A setting's network delay as the tables show it."""
    return f"{sum(DELAY_S) / 2 * 1000:.0f} ms ({DELAY_S[0]}-{DELAY_S[1]} s)" if delay else "none"


ENGINE_COUNTERS = ("steps", "prefill_tokens_computed", "decode_tokens_computed", "preemptions")


@dataclass(frozen=True)
class System:
    """One server configuration compared in an experiment."""

    name: str
    engine: EngineConfig = field(default_factory=EngineConfig)
    manager: ManagerConfig = field(default_factory=ManagerConfig)
    engines: int = 1

    def __post_init__(self) -> None:
        if self.engine.dtype is None:  # the benchmarks' setting unless the config names a dtype
            object.__setattr__(self, "engine", comparable(self.engine))

    def describe(self) -> dict[str, Any]:
        """The configuration as strings, for the JSON payload."""
        return {
            "engines": self.engines,
            "engine_config": _strings(self.engine),
            "manager_config": _strings(self.manager),
        }


def comparable(engine: EngineConfig) -> EngineConfig:
    """``engine`` set so greedy answers compare exactly between systems. On CPU: bfloat16 with
    ``batch_invariant`` where this CPU computes bf16 natively and our kernels are built (a token's result
    then does not depend on its batch, chunking or fork), else float32 — in plain bfloat16 a shared
    prefix's KV, computed once in a step of another shape, rounds differently and greedy answers drift
    apart on a real model. On CUDA: bfloat16 (`flags.bench_dtype`)."""
    if engine.torch_device().type == "cpu" and _cpu_invariance():
        return replace(engine, dtype="bfloat16", batch_invariant=True)
    return replace(engine, dtype=bench_dtype(engine.device))


@functools.cache
def _cpu_invariance() -> bool:
    return (
        cpu_has_native_bf16()
        and cpu_kernels.packed_gemm_ops() is not None
        and cpu_kernels.paged_decode_kernel() is not None
    )


def parrot(
    name: str = "parrot", engine: EngineConfig | None = None, *, engines: int = 1, **manager: Any
) -> System:
    """Parrot: the engine uncapped (its KV cache bounds it), ``manager`` options on `ManagerConfig`."""
    return System(name, engine or EngineConfig(), ManagerConfig(**manager), engines)


def baseline(
    name: str = "baseline",
    engine: EngineConfig | None = None,
    *,
    cap: int | None = None,
    engines: int = 1,
    **manager: Any,
) -> System:
    """The request-centric baseline: the same engine, admitting FIFO under ``cap`` running tokens (the
    paper's latency-centric setting; None: its KV cache), no prefix cache on the OpenAI routes, and any
    other ``manager`` options on `ManagerConfig`."""
    engine = engine or EngineConfig()
    if cap is not None:
        engine = replace(engine, max_running_tokens=cap)
    return System(name, engine, ManagerConfig(**{"openai_prefix_cache": False, **manager}), engines)


@dataclass
class Served:
    """A running system: where to reach it, its engines' counters and its network-delay switch."""

    system: System
    url: str
    engines: Sequence[Any]  # LLMEngine or SimEngine: both have .stats() and .model_name
    delay: NetworkDelayMiddleware | None = None
    server: LaunchedServer | None = None  # None on the simulator
    client: httpx.AsyncClient | None = None
    # The app's live count of answered requests by (method, route), real or simulated.
    request_counts: Counter[tuple[str, str]] = field(default_factory=Counter)

    @property
    def http(self) -> httpx.AsyncClient:
        """The system's HTTP client (inside `connected`, or on the simulator)."""
        if self.client is None:
            raise RuntimeError(f"{self.system.name}: no HTTP client; use `async with connected(servers)`")
        return self.client

    @property
    def model_name(self) -> str:
        return str(self.engines[0].model_name)

    @property
    def tokenizer(self) -> Any:
        return self.engines[0].tokenizer

    def counters(self) -> dict[str, int]:
        """`ENGINE_COUNTERS` summed over the system's engines (diff two readings for one run)."""
        return {name: sum(int(getattr(e.stats(), name)) for e in self.engines) for name in ENGINE_COUNTERS}

    def requests(self) -> Counter[tuple[str, str]]:
        """A copy of the requests answered so far by ``(method, route)``."""
        return Counter(self.request_counts)

    async def drop_kept_contexts(self) -> int:
        """Free every context the manager keeps for reuse (cached prefixes, finished steps), so the next run
        computes its prompts as a new application's would: a repeat of the same job must not find its own
        earlier run's KV (that would time a cache hit, which the baseline has no way to get). Contexts a
        running request forks from stay. On the simulator or a server out of process there is nothing to
        reach: 0 (each simulated run starts on a fresh cluster). Returns how many were dropped."""
        if self.server is None:
            return 0
        server = self.server
        return await asyncio.to_thread(server.run, server.manager.drop_cache())

    def set_delay(self, enabled: bool) -> None:
        if self.delay is None:
            raise ValueError(f"{self.system.name} was started without a network delay")
        self.delay.enabled = enabled


@contextlib.contextmanager
def serve(
    model: str,
    systems: Iterable[System],
    *,
    delay: tuple[float, float] | None = DELAY_S,
    seed: int = 0,
) -> Iterator[dict[str, Served]]:
    """Every system as its own in-process server on ``model``, by name; the delay starts switched off."""
    with contextlib.ExitStack() as stack:
        out: dict[str, Served] = {}
        for system in systems:
            launched = stack.enter_context(
                launch(
                    model,
                    engines=system.engines,
                    engine_config=system.engine,
                    manager_config=system.manager,
                    startup_timeout=120,
                    network_delay=delay,
                    network_delay_seed=seed,
                )
            )
            served = Served(
                system,
                launched.url,
                launched.engines,
                launched.network_delay,
                launched,
                request_counts=launched.request_counts,
            )
            if served.delay is not None:
                served.set_delay(False)
            out[system.name] = served
        yield out


@contextlib.asynccontextmanager
async def simulate(
    system: System, profile: str, *, delay: tuple[float, float] | None = None, seed: int = 0
) -> AsyncIterator[Served]:
    """``system`` on simulated engines with the latency ``profile`` (run inside `server.sim.run`: virtual
    time); its delay, if any, is on."""
    from server.sim import load_profile, sim_cluster

    async with sim_cluster(
        system.engines,
        load_profile(profile),
        engine_config=system.engine,
        manager_config=system.manager,
        network_delay=delay,
        network_delay_seed=seed,
    ) as cluster:
        yield Served(
            system,
            cluster.url,
            cluster.engines,
            cluster.network_delay,
            client=cluster.client,
            request_counts=cluster.app.state.request_counts,
        )


@contextlib.asynccontextmanager
async def connected(servers: Mapping[str, Served], timeout: float = 300.0) -> AsyncIterator[None]:
    """An HTTP client per server (`Served.http`) for the block, on the running event loop."""
    async with contextlib.AsyncExitStack() as stack:
        for s in servers.values():
            s.client = await stack.enter_async_context(httpx.AsyncClient(base_url=s.url, timeout=timeout))
        try:
            yield
        finally:
            for s in servers.values():
                s.client = None


@contextlib.contextmanager
def delayed(servers: Mapping[str, Served] | Iterable[Served], enabled: bool = True) -> Iterator[None]:
    """The network delay switched to ``enabled`` on every server for the block, off afterwards."""
    targets = list(servers.values() if isinstance(servers, Mapping) else servers)
    for s in targets:
        s.set_delay(enabled)
    try:
        yield
    finally:
        for s in targets:
            s.set_delay(False)


def _strings(config: Any) -> dict[str, str]:
    return {f.name: str(getattr(config, f.name)) for f in fields(config)}
