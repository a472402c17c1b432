"""Multi-turn chat over real engines, served three ways (Mutel): what the simulator models, run.

* ``colocated`` — every engine does both phases (vLLM-like); a conversation stays on one engine, whose
  context keeps its KV across turns, so a turn prefills only its new tokens.
* ``splitwise`` — a prefill engine computes the prompt and its first token; the prompt's whole KV moves to
  a decode engine, which generates the rest; the conversation's KV then moves back and the next turn's
  prefill engine imports it. Bytes per turn: the whole conversation, twice.
* ``mutel`` — the prefill engine keeps the conversation's KV (the next turn's prefix, found by locality)
  and lends it (`LLMEngine.lease_kv`); the decode engine holds only the answer and attends over the prompt
  through the prefill engine (`server.engine.remote_kv`); at the turn's end the answer's KV moves back once,
  or is recomputed there, whichever the link makes cheaper (``move_answers``).

Engines are in this process (`LLMEngine`); cross-process serving uses the same engine calls with the
`torch.distributed` transport (`server.engine.remote_kv_dist`).
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field, replace
from typing import Literal

from server.engine import LLMEngine, SamplingParams
from server.engine.kv_transfer import KVBlob
from server.engine.remote_kv import KVLease, RemotePrefix

Policy = Literal["colocated", "splitwise", "mutel"]
POLICIES: tuple[Policy, ...] = ("colocated", "splitwise", "mutel")


@dataclass(frozen=True)
class TurnResult:
    """One turn: the answer, its time to first token and total time, and what it cost the cluster."""

    tokens: list[int]
    ttft_s: float
    total_s: float
    kv_bytes_moved: int  # KV this turn copied between engines
    # The engines' counters over the turn (every engine): exact when nothing else runs meanwhile.
    prefill_tokens: int  # tokens computed as prefill
    exchange_bytes: int  # attention-parallel queries and partials


@dataclass
class _Conversation:
    tokens: list[int] = field(default_factory=list)  # prompts and answers so far
    engine: LLMEngine | None = None  # where its KV lives between turns (colocated, mutel)
    context: int | None = None  # its context there: colocated, every token; mutel, the prompt part
    prompt_len: int = 0  # mutel: the computed tokens of `context` (the last prompt, without the answer)
    answer: list[int] = field(default_factory=list)  # mutel: the last answer, not in `context`
    moved: KVBlob | None = None  # KV waiting to be imported at the next turn (splitwise; mutel's answer)


class DisaggregatedChat:
    """Serves conversations turn by turn under one `Policy` over in-process engines."""

    def __init__(
        self,
        policy: Policy,
        prefill: list[LLMEngine],
        decode: list[LLMEngine] | None = None,
        *,
        move_answers: bool = True,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}; use one of {', '.join(POLICIES)}")
        if policy != "colocated" and not decode:
            raise ValueError(f"{policy} needs decode engines besides the prefill ones")
        self.policy = policy
        self.prefill = prefill
        self.decode = decode or []
        self.move_answers = move_answers
        self._conversations: dict[str, _Conversation] = {}
        self._ids = itertools.count(1)

    async def turn(self, conversation: str, new_tokens: list[int], sampling: SamplingParams) -> TurnResult:
        """Serve the next turn: ``new_tokens`` (the user's message, templated) after the conversation."""
        conv = self._conversations.setdefault(conversation, _Conversation())
        engines = self.prefill + self.decode
        before = [(e.stats().prefill_tokens_computed, e.stats().remote_attention_bytes) for e in engines]
        start = time.perf_counter()
        if self.policy == "colocated":
            tokens, first_at, moved = await self._colocated(conv, new_tokens, sampling)
        elif self.policy == "splitwise":
            tokens, first_at, moved = await self._splitwise(conv, new_tokens, sampling)
        else:
            tokens, first_at, moved = await self._mutel(conv, new_tokens, sampling)
        end = time.perf_counter()
        conv.tokens += new_tokens + tokens
        after = [(e.stats().prefill_tokens_computed, e.stats().remote_attention_bytes) for e in engines]
        return TurnResult(
            tokens,
            first_at - start,
            end - start,
            moved,
            sum(a[0] - b[0] for a, b in zip(after, before, strict=True)),
            sum(a[1] - b[1] for a, b in zip(after, before, strict=True)),
        )

    async def end(self, conversation: str) -> None:
        """Free everything the conversation holds."""
        conv = self._conversations.pop(conversation, None)
        if conv is not None and conv.engine is not None and conv.context is not None:
            await conv.engine.free_context(conv.context)

    # ------------------------------------------------------------------------------------- policies
    async def _colocated(
        self, conv: _Conversation, new: list[int], sampling: SamplingParams
    ) -> tuple[list[int], float, int]:
        engine = conv.engine or _least_loaded(self.prefill)
        ctx = next(self._ids)
        # Forking the whole last context takes its pending last answer token along: the fill computes it.
        await engine.fill(ctx, new, conv.context)
        if conv.context is not None:
            await engine.free_context(conv.context)
        conv.engine, conv.context = engine, ctx
        tokens, first_at = await _stream(engine, ctx, sampling)
        return tokens, first_at, 0

    async def _splitwise(
        self, conv: _Conversation, new: list[int], sampling: SamplingParams
    ) -> tuple[list[int], float, int]:
        prefill, decode = _least_loaded(self.prefill), _least_loaded(self.decode)
        p_ctx, d_ctx = next(self._ids), next(self._ids)
        moved = 0
        if conv.moved is not None:  # the conversation's KV comes back for this turn
            await prefill.import_kv(p_ctx, conv.moved)
            moved += conv.moved.nbytes
        await prefill.fill(p_ctx, conv.tokens[len(conv.moved.token_ids) if conv.moved else 0 :] + new)
        first = (await prefill.generate(p_ctx, _one(sampling))).token_ids
        first_at = time.perf_counter()
        prompt = await prefill.export_kv(p_ctx)  # the prompt's whole KV goes to the decode engine
        await prefill.free_context(p_ctx)
        await decode.import_kv(d_ctx, prompt)
        moved += prompt.nbytes
        tokens = first + await _rest(decode, d_ctx, first, sampling)
        conv.moved = await decode.export_kv(d_ctx)  # and back, for the next turn
        moved += conv.moved.nbytes
        await decode.free_context(d_ctx)
        return tokens, first_at, moved

    async def _mutel(
        self, conv: _Conversation, new: list[int], sampling: SamplingParams
    ) -> tuple[list[int], float, int]:
        prefill = conv.engine or _least_loaded(self.prefill)  # KV locality first
        decode = _least_loaded(self.decode)
        ctx, d_ctx = next(self._ids), next(self._ids)
        moved = 0
        # The last prompt's computed part is the prefix; the answer after it moved back once, or recomputed.
        parent_len = conv.prompt_len if conv.context is not None else None
        if conv.moved is not None:
            await prefill.import_kv(ctx, conv.moved, conv.context, parent_len=parent_len)
            moved += conv.moved.nbytes
            await prefill.fill(ctx, conv.answer[len(conv.moved.token_ids) :] + new)
        else:
            await prefill.fill(ctx, conv.answer + new, conv.context, parent_len=parent_len)
        if conv.context is not None:
            await prefill.free_context(conv.context)
        conv.engine, conv.context, conv.moved = prefill, ctx, None
        first = (await prefill.generate(ctx, _one(sampling))).token_ids
        first_at = time.perf_counter()
        conv.prompt_len = prefill.context_length(ctx) - 1  # all but the pending first token
        lease: KVLease = await prefill.lease_kv(ctx, conv.prompt_len)
        try:
            await decode.fill(d_ctx, first, remote=RemotePrefix(prefill.kv_source, lease))
            rest = await _rest(decode, d_ctx, first, sampling, filled=True)
            if self.move_answers:
                conv.moved = await decode.export_kv(d_ctx)
        finally:
            await decode.free_context(d_ctx)
            await prefill.release_kv(lease)
        conv.answer = first + rest
        return conv.answer, first_at, moved


def _one(sampling: SamplingParams) -> SamplingParams:
    return replace(sampling, max_tokens=1)


def _least_loaded(engines: list[LLMEngine]) -> LLMEngine:
    return min(engines, key=lambda e: (lambda s: s.running + s.waiting)(e.stats()))


async def _stream(engine: LLMEngine, ctx: int, sampling: SamplingParams) -> tuple[list[int], float]:
    tokens: list[int] = []
    first_at = 0.0
    async for token in engine.generate_stream(ctx, sampling):
        if not tokens:
            first_at = time.perf_counter()
        tokens.append(token)
    return tokens, first_at


async def _rest(
    engine: LLMEngine, ctx: int, first: list[int], sampling: SamplingParams, filled: bool = False
) -> list[int]:
    """The answer after its first token, generated on ``engine`` (``first`` filled there unless done)."""
    stops = set(sampling.stop_token_ids) | (set() if sampling.ignore_eos else set(engine.eos_token_ids))
    if not first or sampling.max_tokens <= 1 or first[0] in stops:
        return []
    if not filled:
        await engine.fill(ctx, first)
    return (await engine.generate(ctx, replace(sampling, max_tokens=sampling.max_tokens - 1))).token_ids
