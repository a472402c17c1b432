"""A prefill engine and a decode engine behind the one-engine interface the manager drives (Mutel).

`DisaggregatedEngine` looks like an `LLMEngine` (as `RemoteEngine` does), so sessions, the OpenAI routes,
the prefix store and placement use it unchanged. Contexts live on the prefill engine: fills run there, and
a context's KV stays there across turns. A generate samples its first token there (time to first token is
the prefill's), then the decode engine generates the rest over a lease of that KV (attention parallelism,
`server.engine.remote_kv`), holding only the answer. When the answer is done its KV moves back once into
the context on the prefill engine, so the context ends as it would on one engine — prompt and answer, the
next turn's prefix — and the decode engine holds nothing between requests. Under a TPOT objective the
manager keeps the prefill engine's chunks small enough that the decode engine's steps, which wait on it for
attention every layer, still meet it (`tune_prefill_chunk`, Mutel's coordination).

In one process (`LocalKVSource`); across processes the engines would pair through
`server.engine.remote_kv_dist` instead. A stop string that spans the first token and the next ones is cut
from the text, but the decode engine, which sees only its own tokens, does not stop on it early. Sampling
with a seed stays reproducible, but the decode engine's random stream starts afresh after the first token,
so sampled (not greedy) answers differ from one engine's.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from server.cluster.slo_admission import prefill_chunk_tokens
from server.cluster.task_stream import Emit, TaskStream
from server.engine import EngineError, LLMEngine, SamplingParams
from server.engine.engine_front import GenerationStream
from server.engine.interface import Engine
from server.engine.remote_kv import KVLease, RemotePrefix
from server.engine.request import GenerateResult
from server.engine.sampling import TokenLogprob
from server.engine.wire import EngineStats

_SUMMED = (
    "blocks_total", "blocks_used", "blocks_free", "blocks_peak", "running", "waiting", "tokens_in_last_step",
    "prefill_tokens_computed", "decode_tokens_computed", "steps", "preemptions", "evictions",
    "grouped_decode_steps", "kv_leases", "kv_bytes_moved", "remote_attention_bytes",
)  # fmt: skip


class DisaggregatedEngine(Engine):
    """``prefill`` and ``decode`` engines (same model) serving as one; see the module docstring."""

    def __init__(self, prefill: LLMEngine, decode: LLMEngine) -> None:
        if prefill.model_name != decode.model_name:
            raise ValueError(
                f"a prefill and a decode engine serve one model, not {prefill.model_name!r} and "
                f"{decode.model_name!r}"
            )
        self.prefill, self.decode = prefill, decode
        self.model_name = prefill.model_name
        self.tokenizer = prefill.tokenizer
        self.max_model_len = prefill.max_model_len
        self.block_size = prefill.block_size
        self.vocab_size = prefill.vocab_size
        self.eos_token_ids = prefill.eos_token_ids
        self._decode_ids = itertools.count(1)  # the decode engine's contexts are ours alone
        self.max_prefill_chunk = prefill.config.max_num_batched_tokens  # what the prefill engine started with
        self.prefill_chunk = self.max_prefill_chunk  # its token budget now (`tune_prefill_chunk`)

    async def tune_for_tpot(self, tpot_s: float) -> None:
        """`tune_prefill_chunk`."""
        await self.tune_prefill_chunk(tpot_s)

    async def tune_prefill_chunk(self, tpot_s: float) -> int:
        """Set the prefill engine's chunk from both engines' measured speeds so that the decode engine's
        steps meet ``tpot_s`` (`slo_admission.prefill_chunk_tokens`); unchanged until both are measured.
        The decode step measured includes its waits on the prefill engine, so the chunk settles where the
        two balance. Returns the chunk now in force."""
        chunk = prefill_chunk_tokens(
            self.prefill.stats(), self.decode.stats(), tpot_s, self.max_prefill_chunk
        )
        if chunk is not None and chunk != self.prefill_chunk:
            await self.prefill.set_token_budget(chunk)
            self.prefill_chunk = chunk
        return self.prefill_chunk

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
        """As `LLMEngine.fill`, on the prefill engine."""
        return await self.prefill.fill(
            context_id, token_ids, parent_context_id, parent_len=parent_len, priority=priority, tenant=tenant
        )

    async def score(
        self,
        context_id: int,
        token_ids: list[int],
        top: int = 0,
        *,
        priority: float | None = None,
        tenant: str | None = None,
    ) -> list[TokenLogprob]:
        """As `LLMEngine.score`, on the prefill engine (where the prompt's KV is computed)."""
        return await self.prefill.score(context_id, token_ids, top, priority=priority, tenant=tenant)

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
    ) -> DisaggregatedGeneration:
        """As `LLMEngine.submit_generate`: the first token on the prefill engine, the rest on the decode
        engine over the prompt's KV where it is."""
        options = {"latency_cap": latency_cap, "priority": priority, "tenant": tenant}
        return DisaggregatedGeneration(
            self, context_id, sampling or SamplingParams(), parent_context_id, parent_len, stream, options
        )

    async def free_context(self, context_id: int) -> None:
        await self.prefill.free_context(context_id)

    def context_length(self, context_id: int) -> int:
        return self.prefill.context_length(context_id)

    def stats(self) -> EngineStats:
        """Both engines' load and memory, summed (contexts are the prefill engine's: the decode engine's
        are the answers in flight)."""
        p, d = self.prefill.stats(), self.decode.stats()
        summed = {k: getattr(p, k) + getattr(d, k) for k in _SUMMED}
        return p.model_copy(update=summed | {"role": "both", "decode_step_s": d.decode_step_s})

    def reset_peak_blocks(self) -> None:
        self.prefill.reset_peak_blocks()
        self.decode.reset_peak_blocks()

    def shutdown(self) -> None:
        self.decode.shutdown()
        self.prefill.shutdown()

    def __repr__(self) -> str:
        return f"<DisaggregatedEngine {self.model_name}: prefill + decode>"


class DisaggregatedGeneration(TaskStream):
    """A generate across the pair, like `GenerationStream`: token ids as sampled (``stream=True``), then
    `result()`; `cancel()` aborts it on whichever engine runs it and frees what it holds there."""

    def __init__(
        self,
        engine: DisaggregatedEngine,
        context_id: int,
        sampling: SamplingParams,
        parent_context_id: int | None,
        parent_len: int | None,
        stream: bool,
        options: dict[str, Any],
    ) -> None:
        self._engine = engine
        self._args = (context_id, sampling, parent_context_id, parent_len, options)
        super().__init__(self._generate, stream)

    async def _generate(self, emit: Emit) -> GenerateResult:
        context_id, sampling, parent_context_id, parent_len, options = self._args
        prefill, decode = self._engine.prefill, self._engine.decode
        if sampling.guided is not None:
            # A grammar's state lives with the engine sampling under it: a guided generate runs where it
            # starts (its prompt's KV is there), not split across the two.
            return await prefill.generate(
                context_id, sampling, parent_context_id, parent_len=parent_len, **options
            )
        first = await prefill.generate(
            context_id, replace(sampling, max_tokens=1), parent_context_id, parent_len=parent_len, **options
        )
        for k, token in enumerate(first.token_ids):
            emit(token, None if not first.logprobs else first.logprobs[k])
        window_full = prefill.context_length(context_id) >= self._engine.max_model_len
        if first.finish_reason == "stop" or sampling.max_tokens == 1 or not first.token_ids or window_full:
            return first
        prompt = prefill.context_length(context_id) - 1  # computed: all but the token just sampled
        lease = await prefill.lease_kv(context_id, prompt)
        reader = next(self._engine._decode_ids)
        rest: GenerationStream | None = None
        try:
            await decode.fill(reader, first.token_ids, remote=RemotePrefix(prefill.kv_source, lease))
            rest = decode.submit_generate(
                reader, replace(sampling, max_tokens=sampling.max_tokens - 1), stream=True, **options
            )
            async for k, token in _counted(rest):
                emit(token, rest.logprobs[k] if rest.logprobs else None)
            tail = await rest.result()
            # The answer's KV moves back once, and the context ends as on one engine: prompt and answer,
            # its last token not computed yet (the next turn's prefix).
            answer = await decode.export_kv(reader)
            await prefill.import_kv(context_id, answer, pending=tail.token_ids[len(answer.token_ids) - 1 :])
        finally:
            await asyncio.shield(_release(decode, reader, rest, prefill, lease))
        tokens = first.token_ids + tail.token_ids
        text = _text(self._engine, tokens, sampling)
        logprobs = None if first.logprobs is None else first.logprobs + (tail.logprobs or [])
        return GenerateResult(tokens, text, tail.finish_reason, first.prompt_tokens, logprobs)


async def _counted(stream: GenerationStream) -> AsyncIterator[tuple[int, int]]:
    """A stream's tokens with their place in it."""
    k = 0
    async for token in stream:
        yield k, token
        k += 1


async def _release(
    decode: LLMEngine, reader: int, rest: GenerationStream | None, prefill: LLMEngine, lease: KVLease
) -> None:
    """Abort the decode side if it still runs (and take its outcome, so no error goes unread), free its
    context, let go of the lease."""
    try:
        if rest is not None:
            rest.cancel()
            with contextlib.suppress(EngineError):
                await rest.result()
        await decode.free_context(reader)
    finally:
        await prefill.release_kv(lease)


def _text(engine: DisaggregatedEngine, tokens: list[int], sampling: SamplingParams) -> str:
    text = engine.tokenizer.decode(tokens, skip_special_tokens=True)
    cuts = [i for i in (text.find(s) for s in sampling.stop) if i >= 0]
    return text[: min(cuts)] if cuts else text
