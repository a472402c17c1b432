"""The OpenAI endpoints' side of the manager (`server.openai_api.OpenAIBackend`): which engine serves a
request, and its context's life there.

A request's prompt is forked from the longest kept context its tokens extend and the rest filled, within
its ``cache_salt`` (turn 2 of a chat prefills only its new tokens, as vLLM's automatic prefix caching does);
a completed request's context is kept for the next. Its output length is predicted and sent as its engine
priority (SSJF), Mutel's early rejection refuses it when its engine would miss the SLOs, its tokens count
against its tenant's quota, and a request whose engine failed before it streamed anything runs again on
another engine (``max_step_retries``). The request-centric endpoints thus run on the same engines, caches
and predictor as the Semantic Function steps.
"""

from __future__ import annotations

from collections import Counter

from server.engine import EngineError, SamplingParams
from server.engine.errors import engine_unavailable
from server.engine.interface import Engine
from server.serve.drain_gate import DrainGate
from server.serve.engine_registry import EngineRegistry
from server.serve.errors import SloRejectedError
from server.serve.kept_contexts import KeptContexts, namespace
from server.serve.length_predictor import LengthPredictor
from server.serve.manager_config import ManagerConfig
from server.serve.output_lengths import PROMPT_TAIL_TOKENS, LengthEstimate, OutputLengths
from server.serve.slo_admission import admission
from server.serve.tenant_tokens import TenantTokens


class OpenAIServing:
    """Engines, contexts, priorities, quotas and retries for OpenAI requests."""

    def __init__(
        self,
        registry: EngineRegistry,
        kept: KeptContexts,
        config: ManagerConfig,
        lengths: OutputLengths | None,
        tokens: TenantTokens,
        gate: DrainGate,
    ) -> None:
        self.registry = registry
        self.kept = kept
        self.config = config
        self.lengths = lengths
        self.tokens = tokens
        self.gate = gate
        # Engine index -> OpenAI requests' contexts routed there and not finished: an engine's stats lag
        # behind a burst (a request counts there only once its fill reaches the engine).
        self.routed: Counter[int] = Counter()

    def models(self) -> list[str]:
        return self.registry.models()

    def engine_for(self, model: str | None) -> Engine:
        self.gate.check("requests")
        return self.registry.engines[self._pick(self.registry.serving(model))]

    def _pick(self, candidates: list[int]) -> int:
        """The least loaded engine (lowest index on ties). Its load: the requests it reports, or the OpenAI
        requests routed to it and not finished where more (a burst routed before any fill arrives there
        would otherwise all land on one engine)."""

        def load(i: int) -> int:
            stats = self.registry.engines[i].stats()
            return max(stats.running + stats.waiting, self.routed[i])

        return min(candidates, key=lambda i: (load(i), i))

    def open_context(self, engine: Engine) -> int:
        """A new context id for a request routed to ``engine``: it counts against the engine's load until
        `finish_context`."""
        self.routed[self.registry.index_of(engine)] += 1
        return self.kept.new_id()

    async def fill_prompt(
        self,
        engine: Engine,
        context_id: int,
        token_ids: list[int],
        cache_salt: str | None,
        priority: float | None = None,
        *,
        tenant: str | None = None,
    ) -> None:
        """A request's prompt: forked from the longest cached token prefix, the rest filled; refused first
        if the engine would miss the SLOs (`ManagerConfig.slo`), whose TPOT objective also resizes a
        prefill + decode pair's prefill chunks (`Engine.tune_for_tpot`)."""
        if self.config.slo is not None:
            self._admit(engine, token_ids, cache_salt)
            await engine.tune_for_tpot(self.config.slo.tpot_s)
        if not self.config.openai_prefix_cache:
            await engine.fill(context_id, token_ids, priority=priority, tenant=tenant)
            return
        index = self.registry.index_of(engine)
        await self.kept.fill(index, namespace(cache_salt), context_id, token_ids, priority, tenant)

    def _admit(self, engine: Engine, token_ids: list[int], cache_salt: str | None) -> None:
        """Mutel's early rejection, from the engine's measured step times and queued prompt work (no
        measurement yet: admitted). Only the tokens past a cached prefix count as prefill."""
        assert self.config.slo is not None
        index = self.registry.index_of(engine)
        cached = 0
        if self.config.openai_prefix_cache:
            match = self.kept.match(index, namespace(cache_salt), token_ids)
            cached = 0 if match is None else match.length
        rejection = admission(engine.stats(), index, len(token_ids) - cached, self.config.slo)
        if rejection is not None:
            raise SloRejectedError(f"request refused at admission: {rejection.message}; retry later")

    def estimate_length(
        self, engine: Engine, token_ids: list[int], sampling: SamplingParams
    ) -> LengthEstimate | None:
        """A request's predicted output length (no template: it comes as a whole prompt)."""
        if self.lengths is None:
            return None
        try:
            tail = engine.tokenizer.decode(token_ids[-PROMPT_TAIL_TOKENS:])
        except (OverflowError, ValueError, TypeError):  # ids outside the vocabulary: the engine refuses
            tail = ""  # them with a clear error when the fill is validated, which is not this step's job
        return self.lengths.estimate(None, tail, len(token_ids), sampling)

    def observe_length(self, estimate: LengthEstimate, length: int) -> None:
        if self.lengths is not None:
            self.lengths.observe(estimate, length)

    @property
    def length_predictor(self) -> LengthPredictor | None:
        """The live output-length predictor (None with ``length_prediction`` off)."""
        return None if self.lengths is None else self.lengths.predictor

    async def finish_context(
        self, engine: Engine, context_id: int, token_ids: list[int] | None, cache_salt: str | None
    ) -> None:
        """A request is over: a completed one's context is kept as a cached prefix (the next turn of a chat
        repeats it), anything else freed."""
        index = self.registry.index_of(engine)
        self.routed -= Counter([index])  # drops the engine at zero
        keep = self.config.prefix_sharing and self.config.openai_prefix_cache
        if token_ids is None or not token_ids or not keep:
            await self.registry.free(index, context_id)
            return
        await self.kept.keep(index, namespace(cache_salt), context_id, token_ids)

    def hold_tokens(self, tenant: str, tokens: int) -> str | None:
        return self.tokens.hold(tenant, tokens)

    def release_tokens(self, tenant: str, tokens: int) -> None:
        self.tokens.release(tenant, tokens)

    async def retry_elsewhere(self, engine: Engine, error: EngineError, attempt: int) -> bool:
        """A request failed on ``engine`` on its ``attempt``-th try, before streaming anything. When the
        engine is at fault (`engine_unavailable`) it leaves service and the answer is whether the request
        may run again on another engine (``max_step_retries``)."""
        if not engine_unavailable(error):
            return False
        await self.registry.engine_failed(self.registry.index_of(engine), error)
        return attempt <= self.config.max_step_retries
