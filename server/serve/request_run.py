"""How a request-centric call runs (an OpenAI completion or chat request): a context per prompt and choice,
filled (or scored) through `OpenAIServing` on the engine the placement gives it, then generated.

`run_request` answers a `RequestRun` whose choices have started: a non-streaming run has every result and
its contexts handed back already; a streaming run has each choice's first token and is handed back by its
reader (`RequestRun.release`, also when the reader stops early). Until then nothing reached the client, so
an engine that fails costs nothing: the request runs again where the placement says
(`OpenAIServing.retry_elsewhere`). What the answer looks like is the HTTP edge's business
(`server.http.openai_answer`).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from server.engine.engine_front import GenerationStream
from server.engine.errors import EngineError
from server.engine.interface import Engine
from server.engine.request import GenerateResult
from server.engine.sampling import SamplingParams, TokenLogprob
from server.serve.openai_serving import OpenAIServing, Routed
from server.serve.output_lengths import LengthEstimate
from server.serve.quotas import QuotaExceededError


@dataclass(frozen=True)
class RequestSpec:
    """What a request asks the executor for: ``n`` generations from each of ``prompts`` with ``sampling``.

    ``tenant`` (who sent it) takes turns with other tenants; ``cache_salt`` keeps its cached prefixes apart
    from other salts'; ``priority``: the client's own place in the engines' queues (lower first; None: its
    predicted output length, SSJF). ``stream``: tokens are read as they come. ``score``: each prompt is
    computed whole and its tokens' log-probabilities answered with this many alternatives
    (`Engine.score`). ``generate`` False (``max_tokens=0``): nothing is generated."""

    prompts: list[list[int]]
    sampling: SamplingParams
    n: int = 1
    tenant: str = ""
    cache_salt: str | None = None
    priority: float | None = None
    stream: bool = False
    score: int | None = None
    generate: bool = True

    @property
    def tokens(self) -> int:
        """What the request may hold at most: every generation's prompt and ``max_tokens``."""
        return sum(len(p) + self.sampling.max_tokens for p in self.prompts) * self.n


class NoGeneration:
    """The generate of a ``max_tokens=0`` request: none, over at once with no tokens."""

    def __init__(self, prompt_tokens: int, logprobs: bool) -> None:
        self._result = GenerateResult([], "", "length", prompt_tokens, [] if logprobs else None)
        self.logprobs: list[TokenLogprob] = []

    def __aiter__(self) -> NoGeneration:
        return self

    async def __anext__(self) -> int:
        raise StopAsyncIteration

    async def result(self) -> GenerateResult:
        return self._result

    def cancel(self) -> None:
        """Nothing runs to cancel."""


@dataclass
class RequestChoice:
    """One choice of one prompt: its engine context, its generate and what it produced."""

    context_id: int
    prompt: list[int]
    length: LengthEstimate | None  # its predicted output length, if the server predicts
    sampling: SamplingParams
    choice: int = 0  # which of its prompt's ``n`` choices
    prompt_no: int = 0  # which of the request's prompts
    stream: GenerationStream | NoGeneration | None = None
    first: int | None = None  # a streaming choice's first token, once read (None: it generated none)
    result: GenerateResult | None = None  # once it completed (its context may then be kept)
    scored: list[TokenLogprob] | None = None  # its prompt's tokens' log-probabilities, when scored

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt)


@dataclass
class RequestRun:
    """A started request: its choices (in order: each prompt's ``n`` choices) on ``routed.engine``.

    `release` hands every context back once — completed ones with their tokens (kept as cached prefixes),
    the rest aborted and freed — and ends the request's place in the placement and its tenant's count. The
    hand-backs run in a shielded task: a caller cancelled while waiting (a client that hung up) still hands
    back all of them, not only the first."""

    serving: OpenAIServing
    routed: Routed
    choices: list[RequestChoice]
    cache_salt: str | None
    release_tokens: Callable[[], None]
    released: bool = False

    @property
    def engine(self) -> Engine:
        return self.routed.engine

    async def release(self) -> None:
        if self.released:
            return
        self.released = True  # released once, whoever calls first
        self.release_tokens()
        for c in self.choices:
            if c.stream is not None and c.result is None:
                c.stream.cancel()
            elif c.result is not None and c.length is not None:
                self.serving.observe_length(c.length, len(c.result.token_ids))
        backs = [
            self.serving.finish_context(
                self.routed,
                c.context_id,
                None if c.result is None else c.prompt + c.result.token_ids,
                self.cache_salt,
            )
            for c in self.choices
        ]
        error = None if all(c.result is not None for c in self.choices) else "it did not complete"
        await asyncio.shield(_gather_quietly(backs, lambda: self.serving.unroute(self.routed, error)))


async def run_request(serving: OpenAIServing, engine: Engine, spec: RequestSpec) -> RequestRun:
    """Run ``spec`` on an engine serving ``engine``'s model (the placement picks which) until it has
    started (see the module's docstring); raises the request's error (`EngineError`, `QuotaExceededError`,
    the placement's refusals) with nothing held."""
    for attempt in itertools.count(1):
        try:
            return await _run_on(serving, engine, spec)
        except _EngineFailed as e:
            if not await serving.retry_elsewhere(e.engine, e.cause, attempt):
                raise e.cause from None
            engine = serving.engine_for(engine.model_name)  # engines of one model share the tokenizer
    raise AssertionError("unreachable")


class _EngineFailed(Exception):
    """A request's try failed with ``cause`` on ``engine`` (the one it was routed to) before it streamed."""

    def __init__(self, engine: Engine, cause: EngineError) -> None:
        super().__init__(str(cause))
        self.engine = engine
        self.cause = cause


async def _run_on(serving: OpenAIServing, engine: Engine, spec: RequestSpec) -> RequestRun:
    """`run_request`'s one try, on the engine the placement routes it to."""
    refusal = serving.hold_tokens(spec.tenant, spec.tokens)
    if refusal is not None:
        raise QuotaExceededError(refusal)
    lengths = [serving.estimate_length(engine, p, spec.sampling) for p in spec.prompts]
    first = min((e.priority for e in lengths if e is not None), default=None)  # its shortest prompt's
    priority = spec.priority if spec.priority is not None else first
    try:
        routed = await serving.route(
            engine, spec.prompts, spec.sampling.max_tokens, spec.n, spec.tenant, spec.cache_salt, priority
        )
    except BaseException:
        serving.release_tokens(spec.tenant, spec.tokens)
        raise
    choices = [
        RequestChoice(serving.open_context(), p, length, _nth(spec.sampling, k), k, i)
        for i, (p, length) in enumerate(zip(spec.prompts, lengths, strict=True))
        for k in range(spec.n)
    ]
    run = RequestRun(
        serving, routed, choices, spec.cache_salt, lambda: serving.release_tokens(spec.tenant, spec.tokens)
    )
    started = False
    try:
        await _start(run, spec)
        started = True
        return run
    except EngineError as e:
        raise _EngineFailed(routed.engine, e) from e
    finally:
        if not started or not spec.stream:
            await run.release()


async def _start(run: RequestRun, spec: RequestSpec) -> None:
    """Fill (or score) every choice's context, submit its generate, and read what the run starts with:
    every result (not streamed) or every first token (streamed)."""
    engine = run.engine
    scores = await _gather_all(
        [
            run.serving.fill_prompt(
                run.routed,
                c.context_id,
                c.prompt,
                spec.cache_salt,
                _priority(spec, c),
                tenant=spec.tenant,
                score=spec.score,
            )
            for c in run.choices
        ]
    )
    for c, scored in zip(run.choices, scores, strict=True):
        c.scored = scored
        if not spec.generate:
            c.stream = NoGeneration(c.prompt_tokens, spec.sampling.logprobs is not None)
            continue
        c.stream = engine.submit_generate(
            c.context_id, c.sampling, stream=spec.stream, priority=_priority(spec, c), tenant=spec.tenant
        )
    if not spec.stream:
        results = await _gather_all([c.stream.result() for c in run.choices if c.stream is not None])
        for c, r in zip(run.choices, results, strict=True):
            c.result = r
        return
    for c in run.choices:
        assert c.stream is not None
        c.first = await _first_token(c.stream)


def _nth(sampling: SamplingParams, k: int) -> SamplingParams:
    """The sampling of a prompt's ``k``-th choice: a seeded request seeds each choice apart (seed + k), so
    that ``n`` seeded samples differ and still reproduce."""
    return sampling if k == 0 or sampling.seed is None else replace(sampling, seed=sampling.seed + k)


def _priority(spec: RequestSpec, choice: RequestChoice) -> float | None:
    """The engine priority of a choice: the request's own when it sends one, else its predicted length."""
    if spec.priority is not None:
        return spec.priority
    return None if choice.length is None else choice.length.priority


async def _gather_all(aws: Sequence[Any]) -> list[Any]:
    """Await all; if any failed, raise the first error only after every one has settled."""
    results = await asyncio.gather(*aws, return_exceptions=True)
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results


async def _gather_quietly(aws: Sequence[Any], then: Callable[[], None]) -> None:
    """Await all (engine errors ignored: the context is gone with its engine), then ``then()``."""
    try:
        for r in await asyncio.gather(*aws, return_exceptions=True):
            if isinstance(r, BaseException) and not isinstance(r, EngineError):
                raise r
    finally:
        then()


async def _first_token(stream: GenerationStream | NoGeneration) -> int | None:
    """The first token, or None when the generate ended without one; raises the request's error."""
    try:
        return await anext(stream)
    except StopAsyncIteration:
        await stream.result()
        return None
