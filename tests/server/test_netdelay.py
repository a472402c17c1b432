"""The simulated network delay middleware: once per request, within bounds, excluded paths untouched."""

from __future__ import annotations

import asyncio
import random
import time

import httpx
import pytest
from fastapi import FastAPI

from server.common.netdelay import NetworkDelayMiddleware


def _app() -> FastAPI:
    app = FastAPI()

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics() -> str:
        return "m 1"

    @app.post("/v1/echo")
    async def echo(body: dict[str, int]) -> dict[str, int]:
        return body

    return app


def _client(asgi: NetworkDelayMiddleware) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=asgi), base_url="http://test")


async def test_each_request_is_delayed_once_within_bounds() -> None:
    mw = NetworkDelayMiddleware(_app(), low=0.05, high=0.08, seed=1)
    async with _client(mw) as c:
        for i in range(4):
            start = time.perf_counter()
            r = await c.post("/v1/echo", json={"i": i})
            elapsed = time.perf_counter() - start
            assert r.status_code == 200 and r.json() == {"i": i}
            assert elapsed >= 0.05
    assert mw.requests_delayed == 4
    assert 4 * 0.05 <= mw.total_delay_s <= 4 * 0.08


async def test_excluded_paths_and_disabled_are_not_delayed() -> None:
    mw = NetworkDelayMiddleware(_app(), low=1.0, high=1.0, seed=0)
    async with _client(mw) as c:
        start = time.perf_counter()
        assert (await c.get("/health")).status_code == 200
        assert (await c.get("/metrics")).status_code == 200
        mw.enabled = False
        assert (await c.post("/v1/echo", json={"a": 1})).status_code == 200
        assert time.perf_counter() - start < 0.5
    assert mw.requests_delayed == 0 and mw.total_delay_s == 0.0


async def test_concurrent_requests_wait_concurrently() -> None:
    mw = NetworkDelayMiddleware(_app(), low=0.2, high=0.2, seed=0)
    async with _client(mw) as c:
        start = time.perf_counter()
        rs = await asyncio.gather(*(c.post("/v1/echo", json={"i": i}) for i in range(5)))
        elapsed = time.perf_counter() - start
    assert all(r.status_code == 200 for r in rs)
    assert mw.requests_delayed == 5
    assert elapsed < 0.2 * 5 / 2  # overlapping sleeps, not one after another


def test_delays_are_uniform_in_bounds_and_seeded() -> None:
    a = NetworkDelayMiddleware(_app(), low=0.2, high=0.3, seed=7)
    b = NetworkDelayMiddleware(_app(), low=0.2, high=0.3, seed=7)
    xs = [a.next_delay() for _ in range(2000)]
    assert xs == [b.next_delay() for _ in range(2000)]
    assert all(0.2 <= x <= 0.3 for x in xs)
    assert abs(sum(xs) / len(xs) - 0.25) < 0.005
    shared = random.Random(3)
    c = NetworkDelayMiddleware(_app(), rng=shared)
    assert c.rng is shared
    assert NetworkDelayMiddleware(_app()).low == 0.2 and NetworkDelayMiddleware(_app()).high == 0.3


def test_bad_bounds_are_rejected() -> None:
    with pytest.raises(ValueError, match="low <= high"):
        NetworkDelayMiddleware(_app(), low=0.3, high=0.2)
    with pytest.raises(ValueError):
        NetworkDelayMiddleware(_app(), low=-0.1, high=0.2)


async def test_works_through_add_middleware() -> None:
    app = _app()
    app.add_middleware(NetworkDelayMiddleware, low=0.1, high=0.1, seed=0)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
        start = time.perf_counter()
        assert (await c.post("/v1/echo", json={"x": 2})).json() == {"x": 2}
        assert time.perf_counter() - start >= 0.1
        start = time.perf_counter()
        assert (await c.get("/health")).status_code == 200
        assert time.perf_counter() - start < 0.1
