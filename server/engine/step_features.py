"""What one engine step computes, in the few numbers its time depends on.

The real engine records these per step (with the step's wall time) when ``EngineConfig.trace_steps`` is
set, and the simulator (`server.sim`) predicts a step's time from the very same numbers, so a latency model
fitted on the real engine's trace applies to the simulated one unchanged.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from server.engine.context import blocks_for
from server.engine.model_runner import shared_prefix_blocks
from server.engine.scheduler import ScheduledChunk

__all__ = ["StepFeatures", "StepRecord", "step_features"]


@dataclass(frozen=True)
class StepFeatures:
    """One step's work.

    ``prefill_tokens``: tokens computed by chunks of more than one token (prompts, recomputation).
    ``prefill_attention``: query x key pairs those chunks attend (each token attends its whole prefix).
    ``decode_seqs``: one-token chunks (decodes). ``decode_kv_tokens``: KV tokens the decodes read, each its
    whole context. ``decode_kv_shared``: of those, tokens in leading blocks another decode of the step
    also reads (one multi-query pass reads them once: ``decode_kv_tokens - decode_kv_shared`` is what the
    shared-prefix kernel reads).
    """

    prefill_tokens: int = 0
    prefill_attention: int = 0
    decode_seqs: int = 0
    decode_kv_tokens: int = 0
    decode_kv_shared: int = 0


@dataclass(frozen=True)
class StepRecord:
    """A traced step of the real engine: its features and how long it took (seconds)."""

    features: StepFeatures
    seconds: float


def step_features(batch: list[ScheduledChunk], block_size: int) -> StepFeatures:
    """The features of ``batch`` as the scheduler formed it (before the step updates the contexts)."""
    prefill_tokens = prefill_attention = 0
    tables: list[list[int]] = []
    full: list[int] = []
    kv_tokens = 0
    for c in batch:
        ctx = c.request.context
        if c.num_tokens > 1:
            prefill_tokens += c.num_tokens
            # Token i of the chunk attends num_cached + i + 1 keys.
            prefill_attention += c.num_tokens * ctx.num_cached + c.num_tokens * (c.num_tokens + 1) // 2
        elif c.num_tokens == 1:
            length = ctx.num_cached + 1
            kv_tokens += length
            tables.append(ctx.block_table[: blocks_for(length, block_size)])
            full.append(ctx.num_cached // block_size)
    shared = 0
    by_first: dict[int, list[int]] = defaultdict(list)
    for i, table in enumerate(tables):
        if table:
            by_first[table[0]].append(i)
    for members in by_first.values():
        if len(members) > 1:
            n = shared_prefix_blocks([tables[i] for i in members], [full[i] for i in members])
            shared += (len(members) - 1) * n * block_size
    return StepFeatures(prefill_tokens, prefill_attention, len(tables), kv_tokens, shared)
