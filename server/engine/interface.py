"""The engine interface: what every kind of engine offers the manager, the OpenAI routes and users.

The kinds: `LLMEngine` (in process), `RemoteEngine` (an engine process over HTTP; Ray places those too),
`DisaggregatedEngine` (a prefill + decode pair, Mutel) and `OpenAIBackendEngine` (an OpenAI-compatible
server upstream: vLLM, SGLang, another Parrot). Each implements the four abstract calls; `generate` and
`generate_stream` are defined here once, over `submit_generate`. Where kinds differ, it is a trait with its
default here (that of our own engines) that a kind overrides, so no caller branches on an engine's class;
`tests/server/test_engine_conformance.py` runs every kind through the same calls.
"""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator
from typing import Any

from server.engine.errors import UnsupportedByEngineError
from server.engine.request import GenerateResult
from server.engine.sampling import SamplingParams, TokenLogprob
from server.engine.wire import EngineStats

__all__ = ["Engine"]


class Engine(abc.ABC):
    """An engine of any kind (see the module doc). Contexts are the engine's token sequences with their KV,
    named by the caller's ids: `fill` creates or extends one (forked from a parent), `submit_generate`
    samples from one's end, `free_context` drops one."""

    model_name: str
    tokenizer: Any
    max_model_len: int  # its context window in tokens
    vocab_size: int
    eos_token_ids: frozenset[int]  # the model's end-of-sequence tokens
    block_size: int  # tokens per KV block (a prefix shorter than one is not worth a fork)
    # How status and messages name it, and where it is (None: an engine of this process, which the manager
    # names by its id).
    name: str | None = None
    url: str | None = None
    # Its own prefix cache is its only KV sharing (an upstream server): a lone request follows a prefix
    # running there, as a cache-aware router's would.
    cache_routed: bool = False
    latency_cap_tokens: int | None = None  # its own latency cap, where configured (else the manager's)
    # Its contexts live in the caller's process (an upstream server keeps only token lists here): the
    # manager frees them itself when the engine fails.
    frees_after_failure: bool = False

    @abc.abstractmethod
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
        """Append ``token_ids`` to a context (created, or forked from the parent, if new); returns its
        length. ``parent_len``, ``priority``, ``tenant``: as `generate`'s."""

    async def score(
        self,
        context_id: int,
        token_ids: list[int],
        top: int = 0,
        *,
        priority: float | None = None,
        tenant: str | None = None,
    ) -> list[TokenLogprob]:
        """Fill a new context with ``token_ids`` (no parent) and return the log-probability of each token
        after the first given those before it, with its ``top`` likeliest alternatives: a prompt's
        logprobs (OpenAI's ``echo``, vLLM's ``prompt_logprobs``), computed by the fill's own prefill. The
        context stays, as a fill's does: a generate may follow. ``priority``, ``tenant``: as `generate`'s.
        Kinds that cannot raise `UnsupportedByEngineError`."""
        del context_id, token_ids, top, priority, tenant
        raise UnsupportedByEngineError(
            f"{type(self).__name__} ({self.name or self.model_name}) cannot score prompts (echo, prompt "
            "logprobs): serve this model on a Parrot engine for them"
        )

    @abc.abstractmethod
    async def free_context(self, context_id: int) -> None:
        """Drop a context (a request running on it aborts)."""

    @abc.abstractmethod
    def stats(self) -> EngineStats:
        """Its load, memory and measured speeds."""

    def shutdown(self) -> None:  # noqa: B027  (a default: most kinds run nothing to stop)
        """Stop what the engine runs in this process (its thread, its connections); nothing by default."""

    async def back_in_service(self) -> bool:
        """Whether an engine a failure took out of service may serve again now (an upstream server that
        answers again). Ours come back only by registering anew: never."""
        return False

    async def tune_for_tpot(self, tpot_s: float) -> None:
        """Size what the engine computes per step so that a decode step meets ``tpot_s`` (a prefill + decode
        pair sizes its prefill chunks); an engine with nothing to tune does nothing."""
        del tpot_s

    @abc.abstractmethod
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
    ) -> Any:
        """Start a generate; the returned stream yields token ids, then its ``result()``; ``cancel()``
        aborts it. The arguments are `generate`'s."""

    async def generate(
        self,
        context_id: int,
        sampling: SamplingParams | None = None,
        parent_context_id: int | None = None,
        *,
        latency_cap: int | None = None,
        parent_len: int | None = None,
        priority: float | None = None,
        tenant: str | None = None,
    ) -> GenerateResult:
        """Generate from the end of a context (forked from the parent first if the context is new).

        ``latency_cap``: while this generate runs, the engine's running requests reserve at most this many
        tokens in all, its own included (it waits until they do; alone, it runs whatever its size).
        ``parent_len``: fork from the parent's first ``parent_len`` tokens only, as in `fill`; the last of
        them is then recomputed (one token of prefill) to sample from.
        ``priority``: a finite number, lower starts sooner, when the engine runs ``scheduling="sjf"`` (the
        manager sends the predicted output length; None: ranked as an average request). It orders only the
        waiting queue, with aging (`server.engine.ordering`), and never preempts; ignored under ``fcfs``.
        ``tenant``: who sent it (an id of at most 128 characters): tenants take turns in the waiting queue
        under either scheduling; None: traffic that names no tenant (one tenant in all).
        """
        stream = self.submit_generate(
            context_id,
            sampling,
            parent_context_id,
            stream=False,
            latency_cap=latency_cap,
            parent_len=parent_len,
            priority=priority,
            tenant=tenant,
        )
        result: GenerateResult = await stream.result()
        return result

    async def generate_stream(
        self,
        context_id: int,
        sampling: SamplingParams | None = None,
        parent_context_id: int | None = None,
        *,
        latency_cap: int | None = None,
        parent_len: int | None = None,
        priority: float | None = None,
        tenant: str | None = None,
    ) -> AsyncIterator[int]:
        """Yield token ids as they are sampled; leaving the loop early aborts the request. The arguments are
        `generate`'s."""
        stream = self.submit_generate(
            context_id,
            sampling,
            parent_context_id,
            stream=True,
            latency_cap=latency_cap,
            parent_len=parent_len,
            priority=priority,
            tenant=tenant,
        )
        try:
            async for token_id in stream:
                yield token_id
        finally:
            stream.cancel()
