"""`OpenAIBackendEngine`: any OpenAI-compatible completions server (vLLM, SGLang, another Parrot server) as
one of the manager's engines.

It offers the interface an in-process `LLMEngine` does — ``fill``, ``generate``, ``submit_generate`` (a
stream of token ids), ``free_context``, ``stats()``, ``tokenizer``, ``model_name``, ``max_model_len``,
``block_size`` — so dataflow, transforms, deduction and the scheduler apply unchanged. Such a server has no
contexts and no fork: here a context is the list of its token ids, a fork copies the parent's list, and a
generate sends the context's whole token list as the prompt of ``POST /v1/completions`` (token-id prompts,
``return_token_ids``: vLLM's extensions, which Parrot's own ``/v1`` also speaks). KV is shared by the
server's own prefix cache (vLLM's automatic prefix caching, SGLang's radix cache); the manager's prefix
affinity sends requests that share a prefix to the backend holding it, which is what makes that cache hit.

What cannot be read from a backend comes from `OpenAIBackendConfig`: the tokens it runs at once (the
scheduler's capacity) and its latency cap. The tokenizer is loaded locally (``tokenizer``, else the served
model's name where it names a model here) and checked against the backend's ``POST /tokenize`` where it
offers one, so prompts are tokenized exactly as the backend would. Priorities (Parrot's objectives, the
predicted output length) go to the backend's ``priority`` field only when it schedules by priority (vLLM
with ``--scheduling-policy priority``): any other vLLM refuses a request that carries one.

Errors keep the engine types: a backend that cannot be reached or stops answering is `EngineDeadError`, an
error it answers is `RemoteEngineError` with its status, a prompt over the context window is
`PromptTooLongError` before anything is sent.
"""

from __future__ import annotations

import asyncio
import logging
import math
from dataclasses import dataclass
from typing import Any

import httpx
from parrot.openai_types import openai_sampling

from server.cluster.openai_backend_http import (
    OpenAIBackendConfig,
    check_tokenizer,
    local_tokenizer,
    served_model,
    stream_completion,
)
from server.cluster.task_stream import Emit, TaskStream
from server.engine.errors import (
    ContextBusyError,
    ContextExistsError,
    EngineDeadError,
    InvalidRequestError,
    InvalidSamplingParamsError,
    PromptTooLongError,
    TokenOutOfVocabError,
    UnknownContextError,
)
from server.engine.guided import structured_outputs
from server.engine.interface import Engine
from server.engine.request import GenerateResult
from server.engine.sampling import SamplingParams
from server.engine.wire import EngineStats

__all__ = ["OpenAIBackendConfig", "OpenAIBackendEngine"]

log = logging.getLogger(__name__)


@dataclass
class _Context:
    token_ids: list[int]
    busy: TaskStream | None = None  # the generate running on it
    # The context it was forked from, while its tokens start this one's (a shared prefix).
    parent: _Context | None = None
    # The backend has computed this context's tokens (a generate on it ended): its prefix cache has them.
    computed: bool = False
    # The backend computing them, once a fork needs them (`OpenAIBackendEngine._warmed`).
    warming: asyncio.Task[None] | None = None


class OpenAIBackendEngine(Engine):
    """An OpenAI-compatible server behind the `LLMEngine` interface. Make one with `connect`."""

    name: str
    url: str
    cache_routed = True  # its own prefix cache is its only KV sharing
    frees_after_failure = True  # its contexts are token lists here

    def __init__(
        self, config: OpenAIBackendConfig, model: str, max_model_len: int, tokenizer: Any, eos: set[int]
    ) -> None:
        self.config = config
        self.url = config.url.rstrip("/")
        self.name = f"openai:{self.url}"
        self.model_name = model
        self.max_model_len = max_model_len
        self.block_size = config.block_size
        self.latency_cap_tokens = config.latency_cap_tokens
        self.tokenizer = tokenizer
        self.vocab_size = len(tokenizer)
        self.eos_token_ids = frozenset(eos)
        special = (tokenizer.bos_token_id, tokenizer.eos_token_id)
        self._probe_token = next((t for t in special if isinstance(t, int)), 0)
        self._contexts: dict[int, _Context] = {}
        self._client: httpx.AsyncClient | None = None
        self._closed = False
        self._running_tokens = 0  # prompt + max_tokens of the generates in flight
        self._running = 0
        self.requests_sent = 0
        self.prefixes_warmed = 0
        self.prompt_tokens_sent = 0
        self.completion_tokens_received = 0

    @classmethod
    def connect(cls, config: OpenAIBackendConfig) -> OpenAIBackendEngine:
        """Read the served model from ``config.url`` (``GET /v1/models``), load its tokenizer and check it
        against the backend's ``/tokenize`` where offered. `EngineDeadError` if the backend cannot be reached
        or does not answer as an OpenAI server; `ValueError` for a tokenizer that is missing or differs."""
        url = config.url.rstrip("/")
        with httpx.Client(base_url=url, timeout=config.timeout_s, headers=config.headers) as client:
            card = served_model(client, url, config.model)
            model = str(card["id"])
            max_model_len = config.max_model_len or card.get("max_model_len")
            if not isinstance(max_model_len, int) or max_model_len < 1:
                raise ValueError(
                    f"the OpenAI backend at {url} does not publish its context window (max_model_len): "
                    "configure max_model_len"
                )
            tokenizer = local_tokenizer(config.tokenizer or model, url, explicit=config.tokenizer is not None)
            check_tokenizer(client, url, model, tokenizer)
        eos = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
        for text in card.get("eos_tokens") or []:  # Parrot's cards name every EOS token
            token_id = tokenizer.convert_tokens_to_ids(text)
            if isinstance(token_id, int) and token_id != tokenizer.unk_token_id:
                eos.add(token_id)
        log.info("OpenAI backend %s serves %s (context window %d tokens)", url, model, max_model_len)
        return cls(config, model, max_model_len, tokenizer, eos)

    # ---------------------------------------------------------------------------- the engine interface
    async def fill(
        self,
        context_id: int,
        token_ids: list[int],
        parent_context_id: int | None = None,
        *,
        parent_len: int | None = None,
        priority: float | None = None,
        tenant: str | None = None,
    ) -> int:
        """As `LLMEngine.fill`; nothing is sent (the backend sees the tokens with the generate)."""
        del priority, tenant  # order only a generate, which carries its own
        self._check_tokens(token_ids)
        new = context_id not in self._contexts
        ctx = self._context(context_id, parent_context_id, parent_len, create=True)
        if ctx.busy is not None:
            raise ContextBusyError(f"context {context_id} is generating")
        if len(ctx.token_ids) + len(token_ids) > self.max_model_len:
            if new:  # a refused fill leaves nothing behind
                del self._contexts[context_id]
            raise PromptTooLongError(
                f"context {context_id} would hold {len(ctx.token_ids) + len(token_ids)} tokens, over the "
                f"context window of {self.max_model_len}"
            )
        ctx.token_ids.extend(token_ids)
        return len(ctx.token_ids)

    def submit_generate(
        self,
        context_id: int,
        sampling: SamplingParams | None = None,
        parent_context_id: int | None = None,
        stream: bool = True,
        *,
        latency_cap: int | None = None,
        parent_len: int | None = None,
        priority: float | None = None,
        tenant: str | None = None,
    ) -> TaskStream:
        """Start a generate: the context's tokens go as the prompt; its answer's tokens are appended to it.
        ``latency_cap`` is the scheduler's (the backend batches as it does); ``priority`` is forwarded when
        the backend is configured to take it."""
        del latency_cap, tenant  # the backend orders its own queue
        sampling = sampling or SamplingParams()
        sampling.validate(self.vocab_size)
        ctx = self._context(context_id, parent_context_id, parent_len, create=False)
        if ctx.busy is not None:
            raise ContextBusyError(f"context {context_id} is generating")
        problem: InvalidRequestError | None = None
        if not ctx.token_ids:
            problem = InvalidRequestError(f"context {context_id} is empty: there is nothing to generate from")
        elif len(ctx.token_ids) >= self.max_model_len:
            problem = PromptTooLongError(
                f"context {context_id} holds {len(ctx.token_ids)} tokens, the whole context window of "
                f"{self.max_model_len}: no room to generate"
            )
        if problem is not None:
            if parent_context_id is not None:  # the fork made for this generate goes with it
                del self._contexts[context_id]
            raise problem
        body = self._body(ctx.token_ids, sampling, priority)
        reserved = len(ctx.token_ids) + body["max_tokens"]

        async def produce(emit: Emit) -> GenerateResult:
            self._running += 1
            self._running_tokens += reserved
            try:
                if ctx.parent is not None:
                    await self._warmed(ctx.parent)
                    ctx.parent = None  # needed no more: a chain of forks keeps no ancestor's tokens alive
                self.requests_sent += 1
                result = await self._complete(body, emit)
            finally:
                self._running -= 1
                self._running_tokens -= reserved
                ctx.busy = None
            ctx.token_ids.extend(result.token_ids)
            ctx.computed = True
            return result

        ctx.busy = TaskStream(produce, stream)
        return ctx.busy

    async def free_context(self, context_id: int) -> None:
        """Drop a context; a generate running on it is cancelled (its connection closed, which aborts it
        on the backend)."""
        ctx = self._contexts.pop(context_id, None)
        if ctx is None:
            raise UnknownContextError(f"context {context_id} does not exist")
        if ctx.busy is not None:
            ctx.busy.cancel()

    async def back_in_service(self) -> bool:
        """It answers again (`healthy`) after a failure took it out of service."""
        return await self.healthy()

    async def healthy(self) -> bool:
        """Whether the backend serves again: it answers a one-token completion of this model (a server that
        is up answers its model list even when its engine is dead). The manager asks this of a backend it
        took out of service, to put it back."""
        probe = {"model": self.model_name, "prompt": [self._probe_token], "max_tokens": 1, "temperature": 0}
        try:
            response = await self._http().post(
                "/v1/completions", json=probe, timeout=min(10.0, self.config.timeout_s)
            )
        except (httpx.HTTPError, EngineDeadError):
            return False
        return response.is_success

    def stats(self) -> EngineStats:
        """The load this manager put on the backend (its own counters are not read): generates in flight,
        and the tokens they may fill, in blocks of the configured capacity."""
        bs = self.block_size
        total = self.config.capacity_tokens // bs
        used = min(total, math.ceil(self._running_tokens / bs))
        return EngineStats(
            model=self.model_name,
            block_size=bs,
            blocks_total=total,
            blocks_used=used,
            blocks_free=total - used,
            contexts=len(self._contexts),
            running=self._running,
            waiting=0,
            tokens_in_last_step=0,
            prefill_tokens_computed=self.prompt_tokens_sent,
            decode_tokens_computed=self.completion_tokens_received,
            steps=self.requests_sent,
            preemptions=0,
            evictions=0,
            grouped_decode_steps=0,
            max_model_len=self.max_model_len,
        )

    def shutdown(self) -> None:
        """Stop using the backend (the backend itself keeps running: it is not ours)."""
        self._closed = True
        self._client = None  # its connections close with the loop that made them

    async def aclose(self) -> None:
        self._closed = True
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    def __repr__(self) -> str:
        return f"<OpenAIBackendEngine {self.url} model={self.model_name}>"

    # ---------------------------------------------------------------------------------------- internals
    def _context(
        self, context_id: int, parent_id: int | None, parent_len: int | None, create: bool
    ) -> _Context:
        """Context ``context_id``: forked from ``parent_id`` (its first ``parent_len`` tokens) if given,
        else the existing one, or (``create``) a new empty one."""
        if parent_id is None:
            if parent_len is not None:
                raise InvalidRequestError("parent_len needs parent_context_id")
            ctx = self._contexts.get(context_id)
            if ctx is None:
                if not create:
                    raise UnknownContextError(f"context {context_id} does not exist")
                ctx = self._contexts[context_id] = _Context([])
            return ctx
        if context_id in self._contexts:
            raise ContextExistsError(f"context {context_id} exists: only a new context forks")
        parent = self._contexts.get(parent_id)
        if parent is None:
            raise UnknownContextError(f"parent context {parent_id} does not exist")
        n = len(parent.token_ids) if parent_len is None else parent_len
        if not 0 <= n <= len(parent.token_ids):
            raise InvalidRequestError(
                f"parent_len {parent_len} is outside the parent's {len(parent.token_ids)} tokens"
            )
        ctx = self._contexts[context_id] = _Context(parent.token_ids[:n], parent=parent)
        return ctx

    async def _warmed(self, parent: _Context) -> None:
        """Have the backend compute a shared prefix once, before the forks that share it go out.

        Sent together, requests that share a prefix would each compute it (a prefix cache hits only blocks
        already computed); so the first fork has the backend prefill the parent alone (one token
        generated), and every fork waits for that: Parrot's fill-once-then-fork, through the backend's
        prefix cache. A prefix shorter than `warm_min_tokens` is not worth the round trip."""
        if parent.computed or len(parent.token_ids) < self.config.warm_min_tokens:
            return
        if parent.warming is None:
            parent.warming = asyncio.ensure_future(self._warm(parent))
        await asyncio.shield(parent.warming)

    async def _warm(self, ctx: _Context) -> None:
        body = self._body(list(ctx.token_ids), SamplingParams(max_tokens=1), None)
        try:
            await self._complete(body, lambda _token, _logprob: None)
            ctx.computed = True
            self.prefixes_warmed += 1
        except Exception as e:  # an optimization: the forks go out regardless, and fail on their own
            log.warning("warming a shared prefix on %s failed: %s", self.url, e)

    def _check_tokens(self, token_ids: list[int]) -> None:
        bad = next((t for t in token_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise TokenOutOfVocabError(f"token id {bad} is outside the vocabulary of {self.vocab_size}")

    def _body(self, prompt: list[int], sampling: SamplingParams, priority: float | None) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model_name,
            "prompt": prompt,
            **openai_sampling(sampling),
            "max_tokens": min(sampling.max_tokens, self.max_model_len - len(prompt)),
            "stream": True,
            "return_token_ids": True,
        }
        if sampling.stop_token_ids:
            body["stop_token_ids"] = list(sampling.stop_token_ids)
        if priority is not None and self.config.priority:
            body["priority"] = round(priority)  # vLLM's is an integer, lower first, as ours
        if sampling.guided is not None:
            body["structured_outputs"] = structured_outputs(sampling.guided)
        if sampling.logprobs is not None:
            raise InvalidSamplingParamsError(
                f"logprobs are not relayed through an OpenAI-compatible backend ({self.url}); ask that "
                "server directly, or serve the model on Parrot's own engine"
            )
        return body

    def _http(self) -> httpx.AsyncClient:
        if self._closed:
            raise EngineDeadError(f"the OpenAI backend at {self.url} is out of service")
        if self._client is None:
            # No overall read limit: an answer may stream for minutes; `timeout_s` bounds each silence.
            timeout = httpx.Timeout(self.config.timeout_s)
            self._client = httpx.AsyncClient(base_url=self.url, timeout=timeout, headers=self.config.headers)
        return self._client

    async def _complete(self, body: dict[str, Any], emit: Emit) -> GenerateResult:
        self.prompt_tokens_sent += len(body["prompt"])
        result = await stream_completion(self._http(), self.url, body, emit, self.config.timeout_s)
        self.completion_tokens_received += len(result.token_ids)
        return result
