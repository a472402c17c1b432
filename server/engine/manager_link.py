"""`ManagerLink`: an engine process joins a manager and keeps telling it that it is alive.

``python -m server.engine --manager URL`` runs one next to the engine's HTTP API: it registers the engine
(``POST /v1/engines`` with the URL the manager reaches it at — the manager then reads the model and the
tokenizer from that URL), sends a heartbeat with the engine's stats at the interval the manager asked for,
registers again when the manager no longer knows it (the manager restarted, or timed the engine out), and
retries with backoff while the manager cannot be reached. On `leave` it unregisters. Every request
carries the cluster token (``Authorization: Bearer``); a manager that refuses it is retried like one that
cannot be reached, with its reason logged (it names the setting to fix).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import httpx

from server.engine.wire import (
    EngineHeartbeat,
    EngineHeartbeatAnswer,
    EngineRegistered,
    EngineRegistration,
    EngineStats,
)

__all__ = ["ManagerLink"]

log = logging.getLogger(__name__)

_MAX_BACKOFF_S = 10.0


class ManagerLink:
    """Registers the engine reachable at ``engine_url`` with the manager at ``manager_url`` under ``name``
    and sends ``stats()`` as heartbeats, each request with the ``cluster_token``. `run` loops until
    cancelled; `registered` is set while the manager knows the engine (``engine_id`` is its id there)."""

    def __init__(
        self,
        manager_url: str,
        engine_url: str,
        name: str,
        stats: Callable[[], EngineStats],
        client: httpx.AsyncClient | None = None,
        *,
        cluster_token: str,
    ) -> None:
        self.manager_url = manager_url.rstrip("/")
        self.registration = EngineRegistration(name=name, url=engine_url)
        self.stats = stats
        self._auth = {"Authorization": f"Bearer {cluster_token}"}
        self.engine_id: int | None = None
        self.registered = asyncio.Event()
        self.draining = False  # set by `drain`: every heartbeat from then on says so
        self._client = client

    async def run(self) -> None:
        """Register, then heartbeat; register again whenever the manager forgets the engine."""
        client = self._client or httpx.AsyncClient(timeout=30.0)
        backoff = 0.5
        try:
            while True:
                try:
                    answer = await self._register(client)
                    backoff = 0.5
                    await self._beat(client, answer)
                except httpx.TransportError as e:
                    log.warning(
                        "manager at %s unreachable (%s); retrying in %.1fs", self.manager_url, e, backoff
                    )
                except httpx.HTTPStatusError as e:
                    log.warning(
                        "manager at %s refused: %s; retrying in %.1fs", self.manager_url, _why(e), backoff
                    )
                self.registered.clear()
                await asyncio.sleep(backoff)
                backoff = min(_MAX_BACKOFF_S, backoff * 2)
        finally:
            if self._client is None:
                await client.aclose()

    async def leave(self) -> None:
        """Tell the manager the engine is going away (best effort: it times the engine out otherwise)."""
        if self.engine_id is None or not self.registered.is_set():
            return
        client = self._client or httpx.AsyncClient(timeout=5.0)
        try:
            await client.delete(f"{self.manager_url}/v1/engines/{self.engine_id}", headers=self._auth)
        except httpx.HTTPError as e:
            log.warning("could not unregister from %s: %s", self.manager_url, e)
        finally:
            self.registered.clear()
            if self._client is None:
                await client.aclose()

    async def drain(self, timeout: float = 30.0, poll: float = 0.2) -> None:
        """Announce a graceful shutdown (heartbeats saying ``draining``: the manager places nothing new here)
        and return once the manager has no step running here, or after ``timeout`` seconds. Best effort: an
        unreachable manager ends the wait (it cannot send more work either)."""
        self.draining = True
        if self.engine_id is None or not self.registered.is_set():
            return
        client = self._client or httpx.AsyncClient(timeout=min(timeout, 5.0))
        deadline = asyncio.get_running_loop().time() + timeout
        url = f"{self.manager_url}/v1/engines/{self.engine_id}/heartbeat"
        try:
            while True:
                beat = EngineHeartbeat(stats=self._stats()).model_dump()
                response = await client.post(url, json=beat, headers=self._auth)
                response.raise_for_status()
                answer = EngineHeartbeatAnswer.model_validate(response.json())
                left = deadline - asyncio.get_running_loop().time()
                if answer.steps_running == 0 or left <= 0:
                    if answer.steps_running:
                        log.warning("drain timeout: %d steps still run here", answer.steps_running)
                    return
                await asyncio.sleep(min(poll, left))
        except (httpx.HTTPError, ValueError) as e:
            log.warning("could not drain through %s: %s", self.manager_url, e)
        finally:
            if self._client is None:
                await client.aclose()

    def _stats(self) -> EngineStats:
        stats = self.stats()
        return stats.model_copy(update={"draining": True}) if self.draining else stats

    async def _register(self, client: httpx.AsyncClient) -> EngineRegistered:
        response = await client.post(
            f"{self.manager_url}/v1/engines", json=self.registration.model_dump(), headers=self._auth
        )
        response.raise_for_status()
        answer = EngineRegistered.model_validate(response.json())
        self.engine_id = answer.engine_id
        self.registered.set()
        log.info("registered with %s as engine %d", self.manager_url, answer.engine_id)
        return answer

    async def _beat(self, client: httpx.AsyncClient, answer: EngineRegistered) -> None:
        """Heartbeats until the manager no longer knows the engine (returns) or cannot be reached (raises)."""
        while True:
            url = f"{self.manager_url}/v1/engines/{answer.engine_id}/heartbeat"
            beat = EngineHeartbeat(stats=self._stats()).model_dump()
            response = await client.post(url, json=beat, headers=self._auth)
            if response.status_code == 404:
                log.warning(
                    "manager %s forgot engine %d; registering again", self.manager_url, answer.engine_id
                )
                return
            response.raise_for_status()
            await asyncio.sleep(answer.heartbeat_interval_s)


def _why(e: httpx.HTTPStatusError) -> str:
    return f"{e.response.status_code} {e.response.text[:300]}"
