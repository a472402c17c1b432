"""An engine's death loses nothing: the steps that ran there run again on an engine in service, new work never
goes to it, its cached contexts leave the prefix index, and KV accounting on the survivor stays exact.
A draining engine gets no new work while what runs there finishes.

First at the manager level, with an in-process engine that "dies" on cue (every call then raises
`EngineDeadError`, as a remote engine's broken connection does); then with two engine processes joined to a
manager over HTTP, one of them SIGKILLed while a session's variables are in flight."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import parrot as P
import pytest
from fastapi.testclient import TestClient
from parrot.protocol import PlaceholderSpec, SamplingConfig, SubmitCallRequest

from server.engine import EngineConfig, LLMEngine, SamplingParams
from server.engine.errors import EngineDeadError
from server.http.app import create_app
from server.launcher import LaunchedServer, launch
from server.serve.manager import Manager, ManagerConfig
from server.serve.sessions import Session
from tests.processes import free_port, wait_until

TEMPLATE = "Continue the story: {{input:text}} Next: {{output:next}}"
MAX_TOKENS = 8


# ------------------------------------------------------------------------------------------ helpers
class DyingEngine:
    """A real tiny engine that dies on cue. Generates after the first ``pass_first`` park at a gate; `die`
    makes every later call, and every parked generate once released, raise `EngineDeadError`. Counts the
    fills and generates that arrive after the death (the manager must send none)."""

    def __init__(self, engine: LLMEngine, pass_first: int | None = None) -> None:
        self._engine = engine
        self._pass_first = pass_first
        self._gate = asyncio.Event()
        self.dead = False
        self.generates = 0
        self.parked = 0
        self.work_after_death = 0

    def __getattr__(self, name: str) -> Any:  # tokenizer, block_size, model_name, stats, ...
        return getattr(self._engine, name)

    def die(self) -> None:
        self.dead = True
        self._gate.set()

    def _check(self) -> None:
        if self.dead:
            raise EngineDeadError("the engine at http://fake cannot be reached (ConnectError: refused)")

    async def fill(self, *args: Any, **kwargs: Any) -> int:
        self.work_after_death += self.dead
        self._check()
        return await self._engine.fill(*args, **kwargs)

    async def generate(self, *args: Any, **kwargs: Any) -> Any:
        return await self.submit_generate(*args, **kwargs).result()

    def submit_generate(self, *args: Any, **kwargs: Any) -> Any:
        self.work_after_death += self.dead
        self._check()
        self.generates += 1
        park = self._pass_first is not None and self.generates > self._pass_first
        return _GatedStream(self, park, lambda: self._engine.submit_generate(*args, **kwargs))

    async def _pass_gate(self) -> None:
        self.parked += 1
        await self._gate.wait()
        self._check()

    async def free_context(self, context_id: int) -> None:
        self._check()
        await self._engine.free_context(context_id)


class _GatedStream:
    """A generate of a `DyingEngine`: parked ones start on the real engine only once the gate opens (and
    fail if the engine died meanwhile), whether read token by token or awaited whole."""

    def __init__(self, owner: DyingEngine, park: bool, submit: Any) -> None:
        self._owner, self._park, self._submit = owner, park, submit
        self._inner: Any = None

    async def _started(self) -> Any:
        if self._inner is None:
            if self._park:
                await self._owner._pass_gate()
            self._inner = self._submit()
        return self._inner

    def __aiter__(self) -> _GatedStream:
        return self

    async def __anext__(self) -> int:
        return int(await (await self._started()).__anext__())

    async def result(self) -> Any:
        return await (await self._started()).result()

    def cancel(self) -> None:
        if self._inner is not None:
            self._inner.cancel()


@pytest.fixture(scope="module")
def survivor() -> Iterator[LLMEngine]:
    """The engine that lives (each test leaves it with no context, as it checks)."""
    engine = LLMEngine.from_pretrained("tiny", EngineConfig(num_kv_blocks=256))
    try:
        yield engine
    finally:
        engine.shutdown()


@pytest.fixture
def doomed() -> Iterator[LLMEngine]:
    """The engine under the one that dies: fresh per test, since a dead engine's contexts are never freed."""
    engine = LLMEngine.from_pretrained("tiny", EngineConfig(num_kv_blocks=256))
    try:
        yield engine
    finally:
        engine.shutdown()


async def _until(predicate: Callable[[], bool], timeout: float = 30.0) -> None:
    for _ in range(int(timeout / 0.01)):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise TimeoutError("condition not reached")


async def _reference(engine: LLMEngine, prompt: str, max_tokens: int = MAX_TOKENS) -> str:
    await engine.fill(10**9, engine.tokenizer.encode(prompt))
    out = await engine.generate(10**9, SamplingParams(max_tokens=max_tokens))
    await engine.free_context(10**9)
    return out.text


def _open(manager: Manager) -> Session:
    created = manager.create_session()
    return manager.session(created.session_id, created.token)


def _call(manager: Manager, session: Session, text: str, template: str = TEMPLATE) -> list[str]:
    outputs = [name for name in ("next", "then") if "{{output:" + name + "}}" in template]
    placeholders = [PlaceholderSpec(name="text", role="input", value=text)] + [
        PlaceholderSpec(name=n, role="output", sampling=SamplingConfig(max_tokens=MAX_TOKENS))
        for n in outputs
    ]
    answer = manager.submit_call(session, SubmitCallRequest(template=template, placeholders=placeholders))
    return [answer.outputs[n] for n in outputs]


async def _values(manager: Manager, session: Session, var_ids: list[str]) -> list[tuple[str, str | None]]:
    answers = await asyncio.gather(*(manager.get_variable(session, v, "throughput", 60) for v in var_ids))
    return [(a.status, a.value if a.status == "ready" else a.error) for a in answers]


async def _end(manager: Manager, session: Session, survivor: LLMEngine) -> None:
    """Delete the session, drop the caches: the survivor then holds no block and no context (exact)."""
    await manager.delete_session(session)
    await manager.drop_cache()
    stats = survivor.stats()
    assert stats.blocks_used == 0 and stats.contexts == 0, stats
    assert all(manager.placement.running_tokens(i) == 0 for i in range(len(manager.engines)))


# ------------------------------------------------------------------------------------------ manager level
def test_steps_of_a_dead_engine_run_again_on_the_survivor(doomed: LLMEngine, survivor: LLMEngine) -> None:
    real_a, b = doomed, survivor

    async def run() -> None:
        a = DyingEngine(real_a, pass_first=0)  # every generate on it parks until it dies
        manager = Manager([a, b])  # type: ignore[list-item]
        session = _open(manager)
        texts = [f"tale number {i}" for i in range(8)]
        var_ids = [_call(manager, session, t)[0] for t in texts]
        gets = asyncio.ensure_future(_values(manager, session, var_ids))
        # Every step placed; those on the doomed engine are parked in its generate.
        placed = manager.placement.placed
        await _until(
            lambda: sum(placed.values()) == 8 and a.parked == sum(n for (e, _), n in placed.items() if e == 0)
        )
        assert a.parked >= 1
        a.die()
        extra = _call(manager, session, "a new tale")[0]  # submitted right after the death
        values = await gets
        expected = [await _reference(b, f"Continue the story: {t} Next: ") for t in texts]
        assert values == [("ready", v) for v in expected]
        assert await _values(manager, session, [extra]) == [
            ("ready", await _reference(b, "Continue the story: a new tale Next: "))
        ]
        assert a.work_after_death == 0  # nothing new went to it once its first failure was seen
        assert [s.alive for s in manager.engine_status()] == [False, True]
        assert not manager.kept.store_keys(0)  # its contexts left the prefix index
        await _end(manager, session, b)

    asyncio.run(run())


def test_a_later_step_of_a_call_runs_again_elsewhere_with_the_same_output(
    doomed: LLMEngine,
    survivor: LLMEngine,
) -> None:
    real_a, b = doomed, survivor
    template = "Story: {{input:text}} First: {{output:next}} Then: {{output:then}}"

    async def run() -> None:
        reference = Manager([b])
        session = _open(reference)
        expected = await _values(reference, session, _call(reference, session, "the fox", template))
        await _end(reference, session, b)

        a = DyingEngine(real_a, pass_first=1)  # the call's first step runs there, its second parks
        manager = Manager([a, b])  # type: ignore[list-item]
        session = _open(manager)
        var_ids = _call(manager, session, "the fox", template)
        gets = asyncio.ensure_future(_values(manager, session, var_ids))
        await _until(lambda: a.parked == 1)
        a.die()
        assert await gets == expected and all(status == "ready" for status, _ in expected)
        await _end(manager, session, b)

    asyncio.run(run())


def test_past_the_retry_limit_the_variable_fails_naming_the_engine(
    doomed: LLMEngine,
    survivor: LLMEngine,
) -> None:
    real_a, b = doomed, survivor

    async def run() -> None:
        a = DyingEngine(real_a)
        a.die()  # the manager does not know yet: the first step is placed there (lowest id, both idle)
        manager = Manager([a, b], ManagerConfig(max_step_retries=0))  # type: ignore[list-item]
        session = _open(manager)
        [(status, error)] = await _values(manager, session, _call(manager, session, "doomed"))
        assert status == "failed"
        assert error is not None and "engine 0 (local-0)" in error and "retry limit 0" in error
        # The engine is out of service from then on: the next call runs on the other one.
        [(status, value)] = await _values(manager, session, _call(manager, session, "saved"))
        assert (status, value) == ("ready", await _reference(b, "Continue the story: saved Next: "))
        await _end(manager, session, b)

    asyncio.run(run())


def test_an_openai_request_that_streamed_nothing_runs_on_another_engine(
    doomed: LLMEngine,
    survivor: LLMEngine,
) -> None:
    real_a, b = doomed, survivor
    a = DyingEngine(real_a)
    a.die()
    manager = Manager([a, b])  # type: ignore[list-item]
    expected = asyncio.run(_reference(b, "Once upon", 5))
    with TestClient(create_app(manager)) as client:
        body = {"prompt": "Once upon", "max_tokens": 5, "temperature": 0}
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == expected
        with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            events = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert r.status_code == 200 and events[-1] == "data: [DONE]"
        assert [e.alive for e in manager.engine_status()] == [False, True]
        assert a.work_after_death == 1  # the first request's fill; nothing after it was seen to fail
        client.portal.call(manager.drop_cache)  # type: ignore[union-attr]
    stats = b.stats()
    assert stats.blocks_used == 0 and stats.contexts == 0, stats


# ------------------------------------------------------------------------------------------ engine processes
class _Process:
    """``python -m server.engine --model tiny --manager URL`` as a subprocess."""

    def __init__(self, manager_url: str, name: str, port: int | None = None) -> None:
        self.name = name
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = [sys.executable, "-m", "server.engine", "--model", "tiny", "--port", str(self.port)]
        command += ["--manager", manager_url, "--name", name, "--num-kv-blocks", "256"]
        self.proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=30)


def _live(s: LaunchedServer, name: str) -> int | None:
    """The id of the engine in service under ``name``, if any."""
    for status in s.manager.engine_status():
        if status.name == name and status.alive:
            return status.engine_id
    return None


def _engine_stats(url: str) -> dict[str, Any]:
    token = os.environ.get("PARROT_CLUSTER_TOKEN")
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.get(f"{url}/stats", headers=headers, timeout=10).json()


@pytest.fixture(scope="module")
def cluster() -> Iterator[tuple[LaunchedServer, list[_Process]]]:
    """A manager with two engine processes joined over HTTP. The heartbeat timeout is long (60 s): what
    the tests see happen within it is the failover, not the heartbeat."""
    with pytest.MonkeyPatch.context() as mp:
        # Engines and manager share the cluster token where the CLIs take one (ignored where they do not).
        mp.setenv("PARROT_CLUSTER_TOKEN", os.environ.get("PARROT_CLUSTER_TOKEN", "failover-test-token"))
        config = ManagerConfig(heartbeat_interval=0.2, engine_timeout=60.0)
        with launch("tiny", engines=0, manager_config=config) as s:
            procs = [_Process(s.url, "engine-a"), _Process(s.url, "engine-b")]
            try:
                wait_until(lambda: all(_live(s, p.name) is not None for p in procs), timeout=120)
                yield s, procs
            finally:
                for p in procs:
                    p.kill()


LONG_TOKENS = 160
LONG = P.SemanticFunction.from_template(
    TEMPLATE,
    name="long",
    sampling=P.SamplingConfig(max_tokens=LONG_TOKENS, temperature=0.0, ignore_eos=True),
)


def _placed_on(s: LaunchedServer, engine_id: int) -> int:
    return sum(n for (e, _), n in s.manager.placement.placed.items() if e == engine_id)


def test_a_draining_engine_gets_no_new_work_and_finishes_what_runs(
    cluster: tuple[LaunchedServer, list[_Process]],
) -> None:
    s, procs = cluster
    ids = [_live(s, p.name) for p in procs]
    running = s.manager.placement.running_tokens

    async def drain(engine_id: int, on: bool) -> int:
        s.manager.registry.set_draining(engine_id, on)
        return running(engine_id)

    with P.Session(s.url) as session:
        first = LONG(session.variable("the drained one"))
        session.flush()  # submitted now (not with the first get): it runs at once (eager dispatch)
        wait_until(lambda: any(running(i) > 0 for i in ids if i is not None))
        drained = next(i for i in ids if i is not None and running(i) > 0)
        before = _placed_on(s, drained)
        assert s.run(drain(drained, True)) > 0  # it still runs there as the drain begins
        outs = [LONG(session.variable(f"story {i}")) for i in range(6)]
        assert all(o.get(timeout=120) for o in outs)
        assert first.get(timeout=120)  # what ran on the draining engine finished there
        assert _placed_on(s, drained) == before  # and nothing new went to it
    s.run(drain(drained, False))


def test_killing_an_engine_mid_session_loses_no_variable(
    cluster: tuple[LaunchedServer, list[_Process]], survivor: LLMEngine
) -> None:
    s, procs = cluster
    victim, kept = procs
    victim_id, kept_id = _live(s, victim.name), _live(s, kept.name)
    assert victim_id is not None and kept_id is not None
    running = s.manager.placement.running_tokens
    texts = [f"tale number {i}" for i in range(10)]
    placed_before = sum(s.manager.placement.placed.values())
    with P.Session(s.url) as session:
        outs = [LONG(session.variable(t)) for t in texts]
        session.flush()
        wait_until(lambda: running(victim_id) > 0 and running(kept_id) > 0)  # both engines busy
        victim.kill()
        killed_at = time.monotonic()
        after = LONG(session.variable("after the kill"))  # a new call, right after the kill
        session.flush()
        r = httpx.post(
            f"{s.url}/v1/completions", json={"prompt": "Once", "max_tokens": 5, "temperature": 0}, timeout=60
        )
        assert r.status_code == 200, r.text
        values = [o.get(timeout=120) for o in outs]
        last = after.get(timeout=120)
    assert time.monotonic() - killed_at < s.manager.config.engine_timeout  # not the heartbeat timeout
    assert _live(s, victim.name) is None and _live(s, kept.name) == kept_id
    # The steps that were running on the victim were placed a second time (on the survivor).
    assert sum(s.manager.placement.placed.values()) - placed_before > len(texts) + 1
    reference = survivor

    async def expected(text: str) -> str:
        prompt = f"Continue the story: {text} Next: "
        await reference.fill(10**9, reference.tokenizer.encode(prompt))
        sampling = SamplingParams(max_tokens=LONG_TOKENS, ignore_eos=True)
        out = await reference.generate(10**9, sampling)
        await reference.free_context(10**9)
        return out.text

    assert values == [asyncio.run(expected(t)) for t in texts]
    assert last == asyncio.run(expected("after the kill"))
    # KV on the survivor is exact: with the session gone and the caches dropped, nothing is held.
    s.run(s.manager.drop_cache())
    stats = _engine_stats(kept.url)
    assert stats["blocks_used"] == 0 and stats["contexts"] == 0, stats
    assert running(victim_id) == 0 and running(kept_id) == 0

    # The engine comes back as a new engine: a fresh id, nothing of the old one trusted.
    restarted = _Process(s.url, victim.name, victim.port)
    procs[0] = restarted
    wait_until(lambda: _live(s, victim.name) is not None, timeout=120)
    new_id = _live(s, victim.name)
    assert new_id is not None and new_id != victim_id
    assert not s.manager.kept.store_keys(victim_id)
    with P.Session(s.url) as session:
        assert LONG(session.variable("back again")).get(timeout=120) == asyncio.run(expected("back again"))


def test_sigterm_drains_an_engine_process_through_the_manager(
    cluster: tuple[LaunchedServer, list[_Process]],
) -> None:
    # The first SIGTERM announces `draining` in a heartbeat (the manager places nothing new there), lets the
    # running generation finish where it runs, unregisters and exits 0: nothing is re-run elsewhere.
    s, procs = cluster
    ids = {p.name: _live(s, p.name) for p in procs}
    running = s.manager.placement.running_tokens
    with P.Session(s.url) as session:
        first = LONG(session.variable("the last story of a draining engine"))
        session.flush()
        wait_until(lambda: any(i is not None and running(i) > 0 for i in ids.values()))
        name, engine_id = next((n, i) for n, i in ids.items() if i is not None and running(i) > 0)
        proc = next(p for p in procs if p.name == name)
        placed_before = sum(s.manager.placement.placed.values())
        proc.proc.send_signal(signal.SIGTERM)
        link = s.manager.registry.remote_link(engine_id)
        assert link is not None
        wait_until(lambda: link.draining, timeout=30)  # told before it stops
        ready = httpx.get(f"{proc.url}/health/ready", timeout=10)  # readiness says so while it runs
        assert ready.status_code == 503 and ready.json()["status"] == "draining", ready.text
        later = [LONG(session.variable(f"placed elsewhere {i}")) for i in range(3)]
        assert all(o.get(timeout=120) for o in later)
        assert first.get(timeout=120)
        assert proc.proc.wait(timeout=60) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal
    # One placement per call: the drained engine's step was not re-run.
    assert sum(s.manager.placement.placed.values()) - placed_before == len(later)
    wait_until(lambda: _live(s, name) is None, timeout=30)  # it unregistered


def test_a_model_whose_engines_all_failed_is_503_not_an_unknown_model(
    doomed: LLMEngine, survivor: LLMEngine
) -> None:
    # The dead engine was the only one serving "tiny-a"; another model still has an engine. A request for
    # "tiny-a" is "no engine in service now" (503, retry later), not "no such model" (404).
    a = DyingEngine(doomed)
    a.model_name = "tiny-a"  # type: ignore[attr-defined]
    a.die()
    manager = Manager([a, survivor])  # type: ignore[list-item]
    with TestClient(create_app(manager)) as client:
        body = {"model": "tiny-a", "prompt": "Once upon", "max_tokens": 3}
        first = client.post("/v1/completions", json=body)  # fails over: no other engine serves it
        assert first.status_code == 503, first.text
        again = client.post("/v1/completions", json=body)
        assert again.status_code == 503 and again.json()["error"]["type"] == "no_engine", again.text
        unknown = client.post("/v1/completions", json={**body, "model": "never-served"})
        assert unknown.status_code == 404, unknown.text
        client.portal.call(manager.drop_cache)  # type: ignore[union-attr]


def test_an_operator_hold_survives_the_engines_heartbeats(
    cluster: tuple[LaunchedServer, list[_Process]],
) -> None:
    """A held engine's heartbeats (which say it is not draining itself) do not put it back in service."""
    s, procs = cluster
    engine_id = _live(s, procs[0].name)
    assert engine_id is not None

    async def hold(on: bool) -> None:
        s.manager.registry.set_draining(engine_id, on)

    s.run(hold(True))
    try:
        time.sleep(1.0)  # five heartbeats at 0.2 s
        assert not s.manager.registry.in_service(engine_id)
    finally:
        s.run(hold(False))
    assert s.manager.registry.in_service(engine_id)
