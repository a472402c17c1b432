"""The request-centric side of the manager (the OpenAI endpoints'): which engine serves a request, and its
contexts' life there; `server.serve.request_run` runs a request over these parts.

A request waits for its engine in the manager's `Placement`, as a step does, and goes where a kept context
holds the most of its prompt. Its prompt is forked from the longest kept context its tokens extend and the
rest filled, within its ``cache_salt`` (turn 2 of a chat prefills only its new tokens, as vLLM's automatic
prefix caching does); a completed request's context is kept for the next. Its output length is predicted
and sent as its engine priority (SSJF), Mutel's early rejection refuses it when its engine would miss the
SLOs, its tokens count against its tenant's quota, and a request whose engine failed before it streamed
anything runs again on another engine (``max_step_retries``). The request-centric endpoints thus run on the
same engines, caches, placement and predictor as the Semantic Function steps.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from server.cluster.slo_admission import admission
from server.engine import EngineError, SamplingParams
from server.engine.errors import engine_unavailable
from server.engine.interface import Engine
from server.engine.sampling import TokenLogprob
from server.serve.drain_gate import DrainGate
from server.serve.engine_registry import EngineRegistry
from server.serve.errors import NoEngineError, SloRejectedError
from server.serve.kept_contexts import KeptContexts, namespace
from server.serve.length_predictor import LengthPredictor
from server.serve.manager_config import ManagerConfig
from server.serve.output_lengths import PROMPT_TAIL_TOKENS, LengthEstimate, OutputLengths
from server.serve.placement import NoServingEngineError, Placement
from server.serve.scheduler import QueuedRequest
from server.serve.step_records import StepRecord, StepRecords
from server.serve.tenant_tokens import TenantTokens


@dataclass
class Routed:
    """Where a request runs: its engine, the backend's own handle on its place there (None: none), and the
    prompt tokens its fills forked from kept contexts instead of computing."""

    engine: Engine
    ticket: Any = None
    prefill_tokens_saved: int = 0


@dataclass
class _Ticket:
    """`OpenAIServing`'s handle on a routed request: its engine, and its place in the placement (None: routed
    by load alone, as the request-centric baseline is)."""

    engine_id: int
    request: QueuedRequest | None = None
    record: StepRecord | None = None


class OpenAIServing:
    """Engines, contexts, priorities, quotas and retries for OpenAI requests.

    A request waits for its engine in the same `Placement` as the Semantic Function steps (one request, no
    objective given): tenants take turns there, the engines' caps hold, and it goes where a kept context
    holds the most of its prompt (a chat's next turn finds its last one). It counts in the step records'
    histograms and per-engine prefix hits (``/metrics``, the live view).

    With ``openai_prefix_cache`` off — the request-centric baseline of the benchmarks, vLLM instances behind
    a load balancer — a request goes at once to the least loaded engine and keeps nothing."""

    def __init__(
        self,
        registry: EngineRegistry,
        kept: KeptContexts,
        placement: Placement,
        steps: StepRecords,
        config: ManagerConfig,
        lengths: OutputLengths | None,
        tokens: TenantTokens,
        gate: DrainGate,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.registry = registry
        self.kept = kept
        self.placement = placement
        self.steps = steps
        self.config = config
        self.lengths = lengths
        self.tokens = tokens
        self.gate = gate
        self._clock = clock
        # Engine id -> requests routed there by load and not finished: an engine's stats lag behind a burst
        # (a request counts there only once its fill reaches the engine).
        self._by_load: Counter[int] = Counter()

    def models(self) -> list[str]:
        """The names of the models served, for ``GET /v1/models`` and error messages."""
        return self.registry.models()

    def engine_for(self, model: str | None) -> Engine:
        """An engine serving ``model`` (None: the default one), whose tokenizer and window a request is
        checked against; raises `ModelNotFoundError` (or `ServerDrainingError` while draining)."""
        self.gate.check("requests")
        return self.registry.engines[self.registry.serving(model)[0]]

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
        """Wait until the placement gives the request an engine serving ``engine``'s model; pair with
        `unroute`. It counts its prompts and ``n`` generations of ``max_tokens`` (at most what the largest
        such engine runs at once: the engine itself bounds what one request may hold). ``priority``: its
        place among requests otherwise equal (lower first: its predicted length, SSJF)."""
        serving = self.registry.serving(engine.model_name)
        if not self.config.openai_prefix_cache:
            return self._least_loaded(serving)
        cached: dict[int, int] = {}
        if self.config.prefix_affinity:
            ns = namespace(cache_salt)
            for i in serving:
                match = self.kept.match(i, ns, prompts[0])
                if match is not None:
                    cached[i] = match.length
        most = max(self.registry.caps(self.registry.engines[i])[0] for i in serving)
        key = f"openai/{self.kept.new_id()}"
        request = QueuedRequest(
            key=key,
            app=key,
            seq=self.placement.next_seq(),
            tokens=min(most, n * sum(len(p) + max_tokens for p in prompts)),
            cached=cached,
            model=engine.model_name,
            tenant=tenant,
            priority=priority,
        )
        record = StepRecord("", key, 0, "", "openai", None, None, self._clock())
        try:
            index = await self.placement.acquire(request)
        except NoServingEngineError as e:
            raise NoEngineError(str(e)) from None
        self.steps.started(record, index, self.registry.engine_name(index), self._clock())
        record.prompt_tokens = sum(len(p) for p in prompts)
        return Routed(self.registry.engines[index], _Ticket(index, request, record))

    def _least_loaded(self, serving: list[int]) -> Routed:
        """The engine with the fewest requests (lowest id on ties): those it reports, or those routed here
        and not finished where more."""

        def load(i: int) -> int:
            stats = self.registry.engines[i].stats()
            return max(stats.running + stats.waiting, self._by_load[i])

        index = min(serving, key=lambda i: (load(i), i))
        self._by_load[index] += 1
        return Routed(self.registry.engines[index], _Ticket(index))

    def unroute(self, routed: Routed, error: str | None) -> None:
        """The request `route` placed is over (``error``: why it did not complete): its engine's room is
        free for others."""
        ticket: _Ticket = routed.ticket
        if ticket.request is None or ticket.record is None:
            self._by_load -= Counter([ticket.engine_id])  # drops the engine at zero
            return
        ticket.record.prefill_tokens_saved = routed.prefill_tokens_saved
        self.steps.ended(ticket.record, self._clock(), error)
        self.placement.release(ticket.engine_id, ticket.request)

    def open_context(self) -> int:
        """A context id no other user of any engine holds (handed back with `finish_context`)."""
        return self.kept.new_id()

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
        """A request's prompt: forked from the longest cached token prefix, the rest filled; refused first
        if the engine would miss the SLOs (`ManagerConfig.slo`), whose TPOT objective also resizes a
        prefill + decode pair's prefill chunks (`Engine.tune_for_tpot`). With ``score``, computed whole and
        its tokens' log-probabilities answered (`Engine.score`: a cached prefix's were never computed)."""
        engine = routed.engine
        if self.config.slo is not None:
            self._admit(engine, token_ids, cache_salt, whole=score is not None)
            await engine.tune_for_tpot(self.config.slo.tpot_s)
        if score is not None:
            return await engine.score(context_id, token_ids, score, priority=priority, tenant=tenant)
        if not self.config.openai_prefix_cache:
            await engine.fill(context_id, token_ids, priority=priority, tenant=tenant)
            return None
        index = self.registry.index_of(engine)
        ns = namespace(cache_salt)
        saved = await self.kept.fill(index, ns, context_id, token_ids, priority, tenant)
        routed.prefill_tokens_saved += saved
        return None

    def _admit(self, engine: Engine, token_ids: list[int], cache_salt: str | None, whole: bool) -> None:
        """Mutel's early rejection, from the engine's measured step times and queued prompt work (no
        measurement yet: admitted). Only the tokens past a cached prefix count as prefill, unless the
        prompt is computed ``whole``."""
        assert self.config.slo is not None
        index = self.registry.index_of(engine)
        cached = 0
        if self.config.openai_prefix_cache and not whole:
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
        """A request `estimate_length` predicted wrote ``length`` tokens (the predictor learns from it)."""
        if self.lengths is not None:
            self.lengths.observe(estimate, length)

    @property
    def length_predictor(self) -> LengthPredictor | None:
        """The live output-length predictor (None with ``length_prediction`` off)."""
        return None if self.lengths is None else self.lengths.predictor

    async def finish_context(
        self, routed: Routed, context_id: int, token_ids: list[int] | None, cache_salt: str | None
    ) -> None:
        """A request is over: a completed one's context is kept as a cached prefix (the next turn of a chat
        repeats it), anything else freed."""
        index = self.registry.index_of(routed.engine)
        keep = self.config.prefix_sharing and self.config.openai_prefix_cache
        if token_ids is None or not token_ids or not keep:
            await self.registry.free(index, context_id)
            return
        await self.kept.keep(index, namespace(cache_salt), context_id, token_ids)

    def hold_tokens(self, tenant: str, tokens: int) -> str | None:
        """Count a request's ``tokens`` as ``tenant``'s in flight until `release_tokens`, or refuse them:
        the reason (a tenant's quota)."""
        return self.tokens.hold(tenant, tokens)

    def release_tokens(self, tenant: str, tokens: int) -> None:
        """The request `hold_tokens` counted is over."""
        self.tokens.release(tenant, tokens)

    async def retry_elsewhere(self, engine: Engine, error: EngineError, attempt: int) -> bool:
        """A request failed on ``engine`` on its ``attempt``-th try, before streaming anything. When the
        engine is at fault (`engine_unavailable`) it leaves service and the answer is whether the request
        may run again on another engine (``max_step_retries``)."""
        if not engine_unavailable(error):
            return False
        await self.registry.engine_failed(self.registry.index_of(engine), error)
        return attempt <= self.config.max_step_retries
