"""`generate` and `generate_stream` in terms of `submit_generate`, for every class that offers the engine
interface (`LLMEngine`, and the manager's remote, disaggregated and OpenAI-backend engines)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from server.engine.request import GenerateResult
from server.engine.sampling import SamplingParams

__all__ = ["GeneratesBySubmit"]


class GeneratesBySubmit:
    """A base for engine classes: they implement ``submit_generate`` (a stream of token ids, then its
    ``result()``, and ``cancel()``), and get the two calls the manager and users make on top of it."""

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
        raise NotImplementedError

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
