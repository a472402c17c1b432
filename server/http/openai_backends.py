"""What the OpenAI routes need from the server (`OpenAIBackend`): engines by model name, context ids, a
context's fill and hand-back, length predictions, quotas and retries. The manager's is
`server.serve.openai_serving.OpenAIServing`; `StaticBackend` serves fixed engines, filling whole and freeing.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Mapping
from typing import Protocol

from server.engine.errors import EngineError
from server.engine.interface import Engine
from server.engine.sampling import SamplingParams, TokenLogprob
from server.serve.errors import ModelNotFoundError
from server.serve.openai_serving import Routed
from server.serve.output_lengths import LengthEstimate


class OpenAIBackend(Protocol):
    """What the router needs from the server: engines by model name and fresh context ids."""

    def engine_for(self, model: str | None) -> Engine:
        """The engine serving ``model`` (None: the default one); raises `ModelNotFoundError`."""
        ...

    def models(self) -> list[str]:
        """The names of the models served, for ``GET /v1/models`` and error messages."""
        ...

    async def route(
        self,
        engine: Engine,
        prompts: list[list[int]],
        max_tokens: int,
        n: int,
        tenant: str,
        cache_salt: str | None,
        priority: float | None = None,
    ) -> Routed:
        """Where the request runs: an engine serving ``engine``'s model, once it has room for ``n``
        generations of at most ``max_tokens`` from each prompt (``priority``, lower first: its place among
        requests otherwise equal). The router always calls `unroute` after."""
        ...

    def unroute(self, routed: Routed, error: str | None) -> None:
        """The request is over (``error``: why it did not complete), every context handed back."""
        ...

    def open_context(self, engine: Engine) -> int:
        """A context id no other user of any engine holds, for a request routed to ``engine`` (the router
        always hands it back: `finish_context`)."""
        ...

    async def fill_prompt(
        self,
        routed: Routed,
        context_id: int,
        token_ids: list[int],
        cache_salt: str | None,
        priority: float | None = None,
        *,
        tenant: str | None = None,
        score: int | None = None,
    ) -> list[TokenLogprob] | None:
        """Create ``context_id`` holding ``token_ids`` on the routed engine (from a cached prefix where the
        backend has one, counted in ``routed.prefill_tokens_saved``); ``priority`` and ``tenant`` order it
        in the engine's waiting queue. With ``score`` (top alternatives per token), the prompt is computed
        whole and its tokens' log-probabilities answered (`Engine.score`); else None."""
        ...

    def estimate_length(
        self, engine: Engine, token_ids: list[int], sampling: SamplingParams
    ) -> LengthEstimate | None:
        """The request's predicted output length (its engine priority), or None where the backend predicts
        none."""
        ...

    def observe_length(self, estimate: LengthEstimate, length: int) -> None:
        """A request `estimate_length` predicted wrote ``length`` tokens (the backend learns from it)."""
        ...

    async def finish_context(
        self, routed: Routed, context_id: int, token_ids: list[int] | None, cache_salt: str | None
    ) -> None:
        """A context's request is over: ``token_ids`` is what its context holds (prompt and output) when it
        completed — the backend may keep it as a cached prefix — or None (failed or aborted: free it)."""
        ...

    def hold_tokens(self, tenant: str, tokens: int) -> str | None:
        """Count a request's ``tokens`` (each generation's prompt and max_tokens) as ``tenant``'s in flight
        until `release_tokens`, or refuse them: the reason (a tenant's quota), answered 429."""
        ...

    def release_tokens(self, tenant: str, tokens: int) -> None:
        """The request `hold_tokens` counted is over."""
        ...

    async def retry_elsewhere(self, engine: Engine, error: EngineError, attempt: int) -> bool:
        """The request failed with ``error`` on ``engine`` on its ``attempt``-th try (1 first) before it
        streamed anything: whether to run it again from its prompt on the engine `engine_for` picks next
        (the backend takes a failed engine out of its choice first)."""
        ...


class StaticBackend:
    """An `OpenAIBackend` over fixed engines keyed by model name (the first one is the default).

    Context ids come from one counter starting at ``first_context_id``, chosen high so that they do not
    collide with ids another component hands out on the same engines.
    """

    def __init__(self, engines: Mapping[str, Engine], first_context_id: int = 1 << 40) -> None:
        if not engines:
            raise ValueError("StaticBackend needs at least one engine")
        self._engines = dict(engines)
        self._ids = itertools.count(first_context_id)

    def engine_for(self, model: str | None) -> Engine:
        if model is None:
            return next(iter(self._engines.values()))
        try:
            return self._engines[model]
        except KeyError:
            raise ModelNotFoundError(model, self.models()) from None

    def models(self) -> list[str]:
        return list(self._engines)

    async def route(
        self,
        engine: Engine,
        prompts: list[list[int]],
        max_tokens: int,
        n: int,
        tenant: str,
        cache_salt: str | None,
        priority: float | None = None,
    ) -> Routed:
        return Routed(engine)  # one engine per model: it queues what it cannot run yet

    def unroute(self, routed: Routed, error: str | None) -> None:
        pass

    def open_context(self, engine: Engine) -> int:
        return next(self._ids)

    async def fill_prompt(
        self,
        routed: Routed,
        context_id: int,
        token_ids: list[int],
        cache_salt: str | None,
        priority: float | None = None,
        *,
        tenant: str | None = None,
        score: int | None = None,
    ) -> list[TokenLogprob] | None:
        if score is not None:
            return await routed.engine.score(context_id, token_ids, score, priority=priority, tenant=tenant)
        await routed.engine.fill(context_id, token_ids, priority=priority, tenant=tenant)
        return None

    def estimate_length(
        self, engine: Engine, token_ids: list[int], sampling: SamplingParams
    ) -> LengthEstimate | None:
        return None  # fixed engines keep no history to predict from

    def observe_length(self, estimate: LengthEstimate, length: int) -> None:
        pass

    async def finish_context(
        self, routed: Routed, context_id: int, token_ids: list[int] | None, cache_salt: str | None
    ) -> None:
        await _free_quietly(routed.engine, context_id)

    def hold_tokens(self, tenant: str, tokens: int) -> str | None:
        return None  # fixed engines keep no quotas

    def release_tokens(self, tenant: str, tokens: int) -> None:
        pass

    async def retry_elsewhere(self, engine: Engine, error: EngineError, attempt: int) -> bool:
        return False  # fixed engines: there is nowhere else to go


async def _free_quietly(engine: Engine, context_id: int) -> None:
    with contextlib.suppress(EngineError):
        await engine.free_context(context_id)
