"""Mutel on the manager's live engines: an engine's reported stats as the snapshot that
`server.cluster.mutel.admit` decides on (early rejection), and a prefill engine's chunk size from its decode
partner's step (`server.cluster.mutel.chunk_size`). Pure: stats in, a decision out."""

from __future__ import annotations

from server.cluster.mutel import (
    CostModel,
    InstanceView,
    Rejection,
    Role,
    Slo,
    TurnRequest,
    admit,
    chunk_size,
    predict_prefill,
)
from server.engine.wire import EngineStats

# A decode step waits on its prefill partner layer by layer: each layer's remote attention waits for the
# same layer of the chunk under way, on average half of it (`mutel.chunk_size`'s ``blocking``).
PREFILL_BLOCKING = 0.5


def _measured_cost(stats: EngineStats) -> CostModel:
    """The cost model an engine's measured prefill speed gives (the per-token time holds the pairs)."""
    return CostModel(
        base_s=0.0,
        prefill_token_s=stats.prefill_s_per_token,
        prefill_pair_s=0.0,
        decode_seq_s=0.0,
        kv_token_s=0.0,
        kv_bytes_per_token=0,
        link_bytes_per_s=1.0,
        link_latency_s=0.0,
    )


def prefill_chunk_tokens(
    prefill: EngineStats, decode: EngineStats, tpot_s: float, max_tokens: int
) -> int | None:
    """The prefill chunk (tokens per step) for a prefill engine whose decode partner attends over its KV
    every step: the largest that still lets the partner's step meet the TPOT objective, within
    ``[min(64, max_tokens), max_tokens]`` (the engine's configured budget). None until both speeds are
    measured: nothing to decide on yet."""
    if prefill.prefill_s_per_token <= 0 or decode.decode_step_s <= 0:
        return None
    return chunk_size(
        tpot_s,
        decode.decode_step_s,
        _measured_cost(prefill),
        blocking=PREFILL_BLOCKING,
        min_tokens=min(64, max_tokens),
        max_tokens=max_tokens,
    )


def admission(stats: EngineStats, index: int, new_tokens: int, slo: Slo) -> Rejection | None:
    """Whether a request with ``new_tokens`` prompt tokens to compute may run on the engine ``stats``
    describes. Predicted TTFT: the prompt work queued there and this prompt's, at its measured prefill speed;
    predicted TPOT: its measured decode step. What is not measured yet (0) is not held against it."""
    cost = _measured_cost(stats)
    instance = InstanceView(
        index,
        Role.BOTH,
        kv_capacity=stats.blocks_total * stats.block_size,
        kv_used=stats.blocks_used * stats.block_size,
        queued_prefill_tokens=stats.queued_prefill_tokens,
        running_decodes=stats.running,
        decode_step_s=stats.decode_step_s,
        prefill_s_per_token=stats.prefill_s_per_token,
    )
    turn = TurnRequest(
        conversation=0, turn=0, prompt_tokens=new_tokens, history_tokens=0, expected_output_tokens=0
    )
    decode = instance if stats.decode_step_s > 0 else None
    return admit(predict_prefill(instance, turn, cost), decode, slo, cost, local_tokens=0)
