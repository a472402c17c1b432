"""Mutel's early rejection on the manager's live engines: an engine's reported stats as the snapshot that
`server.serve.mutel.admit` decides on. Pure: stats in, a `Rejection` or None out."""

from __future__ import annotations

from parrot.protocol import EngineStats

from server.serve.mutel import (
    CostModel,
    InstanceView,
    Rejection,
    Role,
    Slo,
    TurnRequest,
    admit,
    predict_prefill,
)


def admission(stats: EngineStats, index: int, new_tokens: int, slo: Slo) -> Rejection | None:
    """Whether a request with ``new_tokens`` prompt tokens to compute may run on the engine ``stats``
    describes. Predicted TTFT: the prompt work queued there and this prompt's, at its measured prefill speed;
    predicted TPOT: its measured decode step. What is not measured yet (0) is not held against it."""
    cost = CostModel(
        base_s=0.0,
        prefill_token_s=stats.prefill_s_per_token,
        prefill_pair_s=0.0,  # (inside the measured per-token time)
        decode_seq_s=0.0,
        kv_token_s=0.0,
        kv_bytes_per_token=0,
        link_bytes_per_s=1.0,
        link_latency_s=0.0,
    )
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
