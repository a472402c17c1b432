"""Mutel's load balancer (`server.cluster.mutel`): every decision on small hand-made snapshots."""

from __future__ import annotations

import pytest

from server.cluster.mutel import (
    CostModel,
    InstanceView,
    PrefillChoice,
    RejectReason,
    Role,
    Slo,
    TurnRequest,
    admit,
    balance_kv,
    choose_decode,
    choose_prefill,
    chunk_size,
    chunk_within,
    move_or_recompute,
    predict_tpot,
)

# Round numbers of the A100 / Llama-13B kind: 20 ms base, 0.1 ms a prompt token, 1 us a KV token read.
COST = CostModel(
    base_s=0.02,
    prefill_token_s=1e-4,
    prefill_pair_s=0.0,
    decode_seq_s=1e-4,
    kv_token_s=1e-6,
    kv_bytes_per_token=800_000,
    link_bytes_per_s=25e9,
    link_latency_s=1e-5,
)
TURN = TurnRequest(conversation=7, turn=2, prompt_tokens=100, history_tokens=2000, expected_output_tokens=300)


def prefill(index: int, **kw: object) -> InstanceView:
    return InstanceView(index, Role.PREFILL, kv_capacity=50_000, **kw)  # type: ignore[arg-type]


def decode(index: int, **kw: object) -> InstanceView:
    return InstanceView(index, Role.DECODE, kv_capacity=50_000, **kw)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------ admission
def test_a_turn_is_rejected_with_its_reason_when_an_slo_would_be_missed() -> None:
    slo = Slo(ttft_s=0.5, tpot_s=0.05)
    quick = PrefillChoice(0, 2000, "recompute", 100, predicted_ttft_s=0.1)
    idle, busy = decode(1, decode_step_s=0.03), decode(2, decode_step_s=0.049)
    assert admit(quick, idle, slo, COST, local_tokens=150, remote_tokens=2100) is None
    assert admit(quick, None, slo, COST, local_tokens=150) is None  # no room yet: it queues, not refused

    late = admit(PrefillChoice(0, 0, "move", 100, predicted_ttft_s=0.8), idle, slo, COST, 150)
    assert late is not None and late.reason is RejectReason.TTFT
    assert (late.predicted_s, late.limit_s, late.http_status) == (0.8, 0.5, 503)
    assert "time to first token" in late.message and "0.500" in late.message

    slow = admit(quick, busy, slo, COST, local_tokens=150, remote_tokens=2100)
    assert slow is not None and slow.reason is RejectReason.TPOT
    assert slow.predicted_s == pytest.approx(predict_tpot(busy, COST, 150, 2100))
    assert slow.predicted_s == pytest.approx(0.049 + 1e-4 + 2250e-6)

    nowhere = admit(None, idle, slo, COST, 150)
    assert nowhere is not None and nowhere.reason is RejectReason.NO_CAPACITY and "room" in nowhere.message


def test_an_idle_decode_instance_is_predicted_at_its_base_step() -> None:
    assert predict_tpot(decode(0), COST, local_tokens=1000) == pytest.approx(0.02 + 1e-4 + 1e-3)


def test_remote_attention_beside_the_local_costs_the_longer_read_not_both() -> None:
    step = decode(0, decode_step_s=0.03)
    assert predict_tpot(step, COST, 150, 2100, overlapped=True) == pytest.approx(0.03 + 1e-4 + 2100e-6)
    assert predict_tpot(step, COST, 3000, 2100, overlapped=True) == pytest.approx(0.03 + 1e-4 + 3000e-6)
    slo = Slo(ttft_s=0.5, tpot_s=0.0323)  # 2,250 us of reads miss it in series; 2,100 fit beside
    quick = PrefillChoice(0, 2000, "recompute", 100, predicted_ttft_s=0.1)
    assert admit(quick, step, slo, COST, 150, 2100) is not None
    assert admit(quick, step, slo, COST, 150, 2100, overlapped=True) is None


# ------------------------------------------------------------------------------------------ prefill
def test_kv_locality_is_preferred_and_worth_the_history_it_saves() -> None:
    holder = prefill(0, held={7: 2000}, queued_prefill_tokens=300)
    idle = prefill(1)
    choice = choose_prefill([idle, holder], TURN, COST)
    assert choice is not None
    assert (choice.instance, choice.reused_tokens, choice.compute_tokens) == (0, 2000, 100)
    assert choice.predicted_ttft_s == pytest.approx(400 * 1e-4)

    # Elsewhere the history is moved (2000 x 800 KB at 25 GB/s = 64 ms) rather than recomputed (200 ms).
    away = choose_prefill([idle], TURN, COST)
    assert away is not None and (away.fetch, away.reused_tokens, away.compute_tokens) == ("move", 0, 100)
    assert away.predicted_ttft_s == pytest.approx(1e-5 + 2000 * 800_000 / 25e9 + 100 * 1e-4)

    # A locality hit is worth the move it saves, no more: behind a long enough queue the idle one wins.
    swamped = prefill(0, held={7: 2000}, queued_prefill_tokens=2000)
    assert choose_prefill([swamped, idle], TURN, COST).instance == 1  # type: ignore[union-attr]
    # Without locality (Splitwise-like), what an instance holds counts for nothing.
    assert choose_prefill([holder, idle], TURN, COST, locality=False).instance == 1  # type: ignore[union-attr]


def test_prefill_load_and_ties_and_roles() -> None:
    a, b = prefill(3, queued_prefill_tokens=500), prefill(1, queued_prefill_tokens=100)
    assert choose_prefill([a, b], TURN, COST).instance == 1  # type: ignore[union-attr]
    assert choose_prefill([prefill(3), prefill(1)], TURN, COST).instance == 1  # type: ignore[union-attr]
    assert choose_prefill([decode(0)], TURN, COST) is None  # decode-only instances never prefill
    assert choose_prefill([InstanceView(0, Role.PREFILL, kv_capacity=1000)], TURN, COST) is None
    # One that has no room now loses to one that has, even with the conversation's KV.
    full = prefill(0, held={7: 2000}, kv_used=49_000)
    assert choose_prefill([full, prefill(1)], TURN, COST).instance == 1  # type: ignore[union-attr]


def test_colocated_routing_keeps_locality_only_while_the_decodes_meet_their_slo() -> None:
    slo = Slo(ttft_s=1.0, tpot_s=0.05)
    holder = InstanceView(0, Role.BOTH, 50_000, held={7: 2000}, decode_step_s=0.049)
    other = InstanceView(1, Role.BOTH, 50_000, decode_step_s=0.03)
    assert choose_prefill([holder, other], TURN, COST).instance == 0  # type: ignore[union-attr]
    assert choose_prefill([holder, other], TURN, COST, slo=slo).instance == 1  # type: ignore[union-attr]


# ------------------------------------------------------------------------------------------ decode
def test_decode_goes_to_the_least_loaded_instance_with_room() -> None:
    fast, slow = decode(2, decode_step_s=0.03), decode(1, decode_step_s=0.04)
    assert choose_decode([slow, fast, prefill(0)], kv_tokens=300) == 2
    assert choose_decode([decode(5, running_decodes=3), decode(4, running_decodes=9)], 300) == 5
    assert choose_decode([decode(5), decode(4)], 300) == 4  # a full tie: the lower index
    tight = decode(2, decode_step_s=0.03, kv_used=49_900)
    assert choose_decode([slow, tight], kv_tokens=300) == 1  # memory first
    assert choose_decode([tight, prefill(0)], kv_tokens=300) is None  # none has room: the turn waits


def test_kv_balancing_moves_a_prompt_to_decode_only_when_prefill_memory_holds_turns_back() -> None:
    views = [prefill(0), decode(1, decode_step_s=0.04), decode(2, decode_step_s=0.03, kv_used=49_000)]
    assert balance_kv(views[0], views, TURN) is None
    waiting = prefill(0, kv_waiting=3000)
    assert balance_kv(waiting, views, TURN) == 1  # instance 2 is faster but has no room for 2,400 tokens
    assert balance_kv(waiting, [waiting, decode(1, kv_used=48_000)], TURN) is None


# ------------------------------------------------------------------------------------------ chunks
def test_chunk_size_keeps_the_waiting_decode_work_within_its_tpot() -> None:
    assert chunk_size(0.05, 0.0, COST) == 2048  # nothing waits: the largest chunk
    assert chunk_size(0.05, 0.03, COST) == 200  # colocated: 20 ms of room at 0.1 ms a token
    assert chunk_size(0.05, 0.06, COST) == 64  # no room: the smallest chunk...
    assert chunk_size(0.05, 0.06, COST, min_tokens=0) == 0  # ...or none, when that is the floor
    assert chunk_size(0.05, 0.001, COST, max_tokens=256) == 256
    # A Mutel prefill instance: its chunk pays the base, a decode step waits for half of it.
    n = chunk_size(0.05, 0.03, COST, fixed_s=0.02, blocking=0.5)
    assert n == 200
    assert 0.03 + 0.5 * (0.02 + n * 1e-4) <= 0.05 + 1e-12 < 0.03 + 0.5 * (0.02 + (n + 1) * 1e-4)
    # Attention over what the prompt has cached makes each token dearer.
    pricey = CostModel(**{**COST.__dict__, "prefill_pair_s": 1e-7})
    assert chunk_size(0.05, 0.03, pricey, cached_tokens=1000) == 100


def test_a_chunk_within_the_gap_between_queries_ends_before_the_next_one() -> None:
    # 25 ms between a decode instance's queries; the chunk's step pays the 20 ms base: 5 ms of tokens.
    assert chunk_within(0.025, COST, fixed_s=0.02) == 64  # 50 tokens fit, the floor is 64
    assert chunk_within(0.025, COST, fixed_s=0.02, min_tokens=0) == 50
    assert chunk_within(0.05, COST, fixed_s=0.02, min_tokens=0) == 300
    assert chunk_within(0.01, COST, fixed_s=0.02, min_tokens=0) == 0  # the base alone outlasts the gap
    assert chunk_within(1.0, COST, max_tokens=512) == 512


# ------------------------------------------------------------------------------------------ move
def test_move_or_recompute_goes_both_ways() -> None:
    kib = 800_000
    assert move_or_recompute(500, kib, 25e9, prefill_s_per_token=1.4e-4) == "move"  # 32 us < 140 us a token
    assert move_or_recompute(500, kib, 2e9, prefill_s_per_token=1.4e-4) == "recompute"  # 400 us a token
    assert move_or_recompute(1, kib, 25e9, 1.4e-4, 1e-3) == "recompute"  # one token: latency dominates
    assert move_or_recompute(0, kib, 25e9, 1.4e-4) == "recompute"  # nothing to move
