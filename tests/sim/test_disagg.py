"""The disaggregation simulator (`server.sim.disagg`): determinism, conservation of turns, KV accounting,
what each policy moves over the link, monotone latency, and the sustained-rate bisection."""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import pytest

from server.cluster.mutel import RejectReason, Slo
from server.sim import disagg
from server.sim.disagg import Policy, SimResult, max_sustained_rate, simulate
from server.sim.disagg_cost import NVLINK, PCIE4_X16, a100_llama13b
from server.sim.disagg_workload import Conversation, Turn, WorkloadSpec, at_rate, sharegpt_like

COST = a100_llama13b(PCIE4_X16)
SLO = Slo(ttft_s=1.0, tpot_s=0.06)
POLICIES = [Policy.of("colocated"), Policy.of("splitwise", 1), Policy.of("mutel", 2)]


def run(policy: Policy, rate: float, duration_s: float = 60.0, **options: object) -> SimResult:
    return simulate(policy, SLO, at_rate(WorkloadSpec(), rate, duration_s), COST, **options)  # type: ignore[arg-type]


def outcome(result: SimResult) -> list[tuple[float, float, object]]:
    return [(r.first_s, r.done_s, r.rejected) for r in result.records]


def test_the_model_follows_from_the_profile() -> None:
    assert COST.kv_bytes_per_token == 40 * 2 * 5120 * 2 == 800 * 1024
    assert COST.latency.kv_tokens * COST.kv_bytes_per_token < 80 * 2**30 - 26e9  # room left for weights
    assert COST.transfer_s(1000, host=False) == pytest.approx(10e-6 + 1000 * 819_200 / 25e9)
    assert a100_llama13b(NVLINK).transfer_s(1000, host=True) == COST.transfer_s(1000, host=True)  # PCIe
    # Per layer: the query out, a partial output and 40 fp32 log-sum-exps back.
    assert COST.exchange_bytes(1) == 40 * (2 * 5120 * 2 + 40 * 4)
    assert COST.exchange_s(10) == pytest.approx(40 * (2 * 10e-6 + 10 * (2 * 5120 * 2 + 160) / 25e9))


def test_a_mutel_decode_step_reads_its_remote_prompt_beside_its_local_kv() -> None:
    # One 2,000-token turn alone: its 50 decode steps each wait for the exchange and the attention over
    # the prompt on the prefill instance (longer than the <= 50 tokens of local KV read meanwhile), and
    # not for the prompt's own prefill chunk, which ended when the first token was sampled.
    alone = [Conversation(0, 0.0, (Turn(2000, 50, 0.0),))]
    turn = simulate(Policy.of("mutel", 1, instances=2), SLO, alone, COST, stop_on_fail=False).records[0]
    m = COST.latency
    assert turn.tpot_s == pytest.approx(m.base + m.decode_seq + COST.exchange_s(1) + m.kv_token * 2000)
    colocated = simulate(Policy.of("colocated", instances=1), SLO, alone, COST, stop_on_fail=False)
    assert turn.ttft_s == colocated.records[0].ttft_s


def test_the_workload_is_seeded_prefix_stable_and_fits_the_window() -> None:
    spec = WorkloadSpec()
    some, more = sharegpt_like(spec, 50), sharegpt_like(spec, 100)
    assert some == more[:50]
    assert sharegpt_like(dataclasses.replace(spec, seed=1), 50) != some
    assert all(1 <= len(c.turns) <= 8 and c.tokens <= 4096 for c in more)
    assert all(t.output_tokens >= 2 for c in more for t in c.turns)
    fast = at_rate(spec, 2.0, 30.0)
    assert [c.turns for c in fast] == [c.turns for c in more[: len(fast)]]  # the same conversations, sooner
    assert max(c.start_s for c in fast) < 30.0 <= more[len(fast)].start_s / 2.0


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: p.label)
def test_a_run_is_deterministic_and_every_turn_finishes_or_is_rejected_with_a_reason(policy: Policy) -> None:
    conversations = at_rate(WorkloadSpec(), 1.5, 40.0)
    first = simulate(policy, SLO, conversations, COST, stop_on_fail=False, drain_s=3000)
    again = simulate(policy, SLO, conversations, COST, stop_on_fail=False, drain_s=3000)
    assert outcome(first) == outcome(again) and first.moved_bytes == again.moved_bytes
    by_conversation = {c.id: c for c in conversations}
    seen: dict[int, list[int]] = {}
    for r in first.records:
        if r.rejected is None:
            assert r.first_s >= r.arrival_s and r.done_s >= r.first_s, r
            assert math.isfinite(r.ttft_s) and math.isfinite(r.tpot_s)
        else:
            assert isinstance(r.rejected, RejectReason) and math.isinf(r.ttft_s)
        seen.setdefault(r.conversation, []).append(r.turn)
    assert set(seen) == set(by_conversation)
    for cid, turns in seen.items():  # every turn ran, up to the end or to a rejection that ended it
        assert turns == list(range(len(turns)))
        last = next(r for r in reversed(first.records) if r.conversation == cid)
        assert len(turns) == len(by_conversation[cid].turns) or last.rejected is not None


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: p.label)
def test_kv_never_exceeds_an_instances_capacity(policy: Policy) -> None:
    small = dataclasses.replace(COST, latency=dataclasses.replace(COST.latency, kv_tokens=12_000))
    result = simulate(policy, SLO, at_rate(WorkloadSpec(), 2.0, 40.0), small, stop_on_fail=False)
    assert result.kv_capacity == 12_000
    assert max(result.peak_kv) <= 12_000
    assert max(result.peak_kv) > 10_000  # the memory did fill: the bound was tested
    assert any(r.done_s == r.done_s for r in result.records)


def test_splitwise_moves_whole_contexts_and_mutel_only_the_exchange_and_the_answers() -> None:
    light = at_rate(WorkloadSpec(), 0.5, 60.0)
    kib = COST.kv_bytes_per_token
    split = simulate(Policy.of("splitwise", 2), SLO, light, COST, stop_on_fail=False, drain_s=3000)
    done = [r for r in split.records if r.rejected is None]
    assert split.moved_bytes["kv_to_decode"] == sum(r.context_tokens for r in done) * kib
    assert split.moved_bytes["history_load"] == sum(r.history_tokens for r in done) * kib
    assert "exchange" not in split.moved_bytes

    # One prefill instance, so no turn is balanced away from its KV; light load, so none is evicted.
    mutel = simulate(Policy.of("mutel", 1), SLO, light, COST, stop_on_fail=False, drain_s=3000)
    done = [r for r in mutel.records if r.rejected is None]
    answers = sum(r.output_tokens for r in done) * kib
    assert "kv_to_decode" not in mutel.moved_bytes  # every prompt's KV stays where it was made
    # An answer moves back once (or, when the next turn came first, from host memory with it).
    assert mutel.moved_bytes["kv_back"] + mutel.moved_bytes.get("history_load", 0) <= answers
    assert 0 < mutel.moved_bytes["exchange"] < split.moved_bytes["kv_to_decode"]
    link = {name: sum(v for kind, v in r.moved_bytes.items() if kind != "host_write") for name, r in
            (("mutel", mutel), ("splitwise", split))}  # fmt: skip
    assert link["mutel"] < link["splitwise"] / 2


def test_a_higher_rate_never_lowers_p90_ttft_on_one_instance() -> None:
    one = Policy.of("colocated", instances=1)
    single = dataclasses.replace(WorkloadSpec(), max_turns=1)  # one turn each: a plain open queue
    p90s = [
        simulate(one, SLO, at_rate(single, rate, 120.0), COST, stop_on_fail=False).p90_ttft_s
        for rate in (0.5, 1.0, 2.0, 4.0, 8.0)
    ]
    assert p90s == sorted(p90s) and p90s[-1] > p90s[0]


def test_overload_is_refused_early_with_reasons_and_the_slo_is_lost() -> None:
    result = run(Policy.of("mutel", 2), rate=24.0, duration_s=40.0)
    assert not result.meets
    assert {r.rejected for r in result.records} - {None} <= set(RejectReason)
    assert any(r.rejected is not None for r in result.records)
    assert run(Policy.of("mutel", 2), rate=0.5).meets


def test_bisection_brackets_then_narrows_to_the_tolerance(monkeypatch: pytest.MonkeyPatch) -> None:
    class Tagged(list):  # the conversations of one rate, tagged with it
        rate = 0.0

    def at(spec: WorkloadSpec, rate: float, duration_s: float) -> Tagged:
        out = Tagged([Conversation(0, 0.0, (Turn(10, 10, 0.0),) * 3)])
        out.rate = rate
        return out

    def passes_below(limit: float) -> object:
        return lambda policy, slo, conversations, cost, **_: SimpleNamespace(
            meets=conversations.rate <= limit, measured=[]
        )

    monkeypatch.setattr(disagg, "at_rate", at)
    monkeypatch.setattr(disagg, "simulate", passes_below(3.3))
    found = max_sustained_rate(POLICIES[0], SLO, WorkloadSpec(), COST, duration_s=100.0, tolerance=0.02)
    passed = [r for r, ok in found.tried if ok]
    failed = [r for r, ok in found.tried if not ok]
    assert found.tried[:3] == ((1.0, True), (2.0, True), (4.0, False))
    assert found.conversations_per_s == max(passed) <= 3.3 < min(failed) <= max(passed) * 1.02
    assert found.requests_per_s == pytest.approx(3 / 100)  # three turns in the 100 s window

    monkeypatch.setattr(disagg, "simulate", passes_below(0.5))
    assert max_sustained_rate(POLICIES[0], SLO, WorkloadSpec(), COST).tried[:3] == (
        (1.0, False), (0.5, True), (math.sqrt(0.5), False)
    )  # fmt: skip
    monkeypatch.setattr(disagg, "simulate", passes_below(0.0))
    assert max_sustained_rate(POLICIES[0], SLO, WorkloadSpec(), COST).conversations_per_s == 0


def test_the_sustained_rate_passes_and_a_little_more_fails() -> None:
    policy = Policy.of("splitwise", 1)
    found = max_sustained_rate(policy, SLO, WorkloadSpec(), COST, duration_s=120.0, tolerance=0.1)
    assert found.conversations_per_s > 0
    assert max(r for r, ok in found.tried if ok) == found.conversations_per_s
    assert min(r for r, ok in found.tried if not ok) <= found.conversations_per_s * 1.1 + 1e-9
    assert found.rejected_share == 0  # no early rejection without admission control


def test_the_share_mutel_refuses_at_its_sustained_rate_is_reported() -> None:
    found = max_sustained_rate(
        Policy.of("mutel", 2), SLO, WorkloadSpec(), COST, duration_s=60.0, tolerance=0.2
    )
    at = simulate(Policy.of("mutel", 2), SLO, at_rate(WorkloadSpec(), found.conversations_per_s, 60.0), COST)
    refused = [r.rejected is not None for r in at.measured]
    assert found.rejected_share == sum(refused) / len(refused) <= 0.1


def test_policies_reject_impossible_splits() -> None:
    with pytest.raises(ValueError, match="cannot run"):
        Policy("mutel", prefill_instances=4)
    with pytest.raises(ValueError, match="cannot run"):
        Policy("colocated", prefill_instances=1)
    with pytest.raises(ValueError, match="unknown policy"):
        Policy("fastest")
    assert Policy.of("mutel", 1).label == "mutel 1P+3D" and Policy.of("mutel").admission
    assert not Policy.of("splitwise").admission and Policy.of("colocated").prefill_instances == 0
