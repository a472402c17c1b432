"""Mutel's early rejection on the manager (`ManagerConfig.slo`): a request whose engine would miss the TTFT
or TPOT objective is refused at once with a typed 503 that says why; nothing is refused before anything is
measured, nor with generous objectives; the engine keeps serving. On a prefill + decode pair, the prefill
engine's chunk follows the TPOT objective (Mutel's coordination)."""

from __future__ import annotations

import httpx

from server.cluster.disagg_engine import DisaggregatedEngine
from server.cluster.mutel import RejectReason, Slo
from server.cluster.slo_admission import admission, prefill_chunk_tokens
from server.engine import EngineConfig
from server.engine.wire import EngineStats
from server.launcher import launch
from server.serve.manager import ManagerConfig

PROMPT = "A prompt of a few dozen tokens, long enough that its prefill is timed per token: " * 2


def _stats(**measured: float) -> EngineStats:
    base = {"model": "m", "block_size": 16, "blocks_total": 64, "blocks_used": 4, "blocks_free": 60}
    zeros = dict.fromkeys(
        ("contexts", "running", "waiting", "tokens_in_last_step", "prefill_tokens_computed",
         "decode_tokens_computed", "steps", "preemptions", "evictions", "grouped_decode_steps"),
        0,
    )  # fmt: skip
    return EngineStats(**base, **zeros, max_model_len=4096, **measured)  # type: ignore[arg-type]


def test_admission_predicts_from_measured_speed_and_queued_work() -> None:
    slo = Slo(ttft_s=0.5, tpot_s=0.05)
    assert admission(_stats(), 0, 10_000, slo) is None  # nothing measured: admitted
    busy = _stats(prefill_s_per_token=1e-3, queued_prefill_tokens=400)
    assert admission(busy, 0, 50, slo) is None  # (400 + 50) ms of prefill ahead: within 0.5 s
    late = admission(busy, 0, 200, slo)
    assert late is not None and late.reason is RejectReason.TTFT
    assert late.predicted_s == 0.6 and "time to first token 0.600 s exceeds its SLO, 0.500 s" in late.message
    slow = admission(_stats(decode_step_s=0.08), 0, 10, slo)
    assert slow is not None and slow.reason is RejectReason.TPOT and "time per output token" in slow.message


def test_the_server_refuses_what_would_miss_its_slo_and_serves_on() -> None:
    strict = ManagerConfig(slo=Slo(ttft_s=1e-9, tpot_s=60.0))
    with launch("tiny", engine_config=EngineConfig(num_kv_blocks=128), manager_config=strict) as s:
        body = {"prompt": PROMPT, "max_tokens": 4}
        first = httpx.post(f"{s.url}/v1/completions", json=body, timeout=60)
        assert first.status_code == 200  # before any step was timed
        second = httpx.post(f"{s.url}/v1/completions", json={**body, "prompt": "Other text. " + PROMPT})
        assert second.status_code == 503
        error = second.json()["error"]
        assert error["type"] == "slo_rejected" and "time to first token" in error["message"]
        # A cached prompt has nothing left to prefill: admitted even under this objective.
        again = httpx.post(f"{s.url}/v1/completions", json=body, timeout=60)
        assert again.status_code == 200, again.text

    generous = ManagerConfig(slo=Slo(ttft_s=60.0, tpot_s=60.0))
    with launch("tiny", engine_config=EngineConfig(num_kv_blocks=128), manager_config=generous) as s:
        for i in range(3):
            r = httpx.post(f"{s.url}/v1/completions", json={"prompt": f"{i} {PROMPT}", "max_tokens": 4})
            assert r.status_code == 200


def test_a_prefill_engines_chunk_leaves_its_decode_partner_room_for_the_tpot_objective() -> None:
    tpot = 0.05
    prefill, decode = _stats(prefill_s_per_token=1e-4), _stats(decode_step_s=0.02)
    assert prefill_chunk_tokens(_stats(), decode, tpot, 2048) is None  # prefill speed not measured yet
    assert prefill_chunk_tokens(prefill, _stats(), tpot, 2048) is None  # nor the decode step
    # Room: (0.05 - 0.02) / 0.5 (a layer waits on average half the chunk's) = 60 ms = 600 tokens at 0.1 ms.
    assert prefill_chunk_tokens(prefill, decode, tpot, 2048) == 600
    assert prefill_chunk_tokens(prefill, decode, tpot, 512) == 512  # never above the engine's own budget
    assert prefill_chunk_tokens(prefill, _stats(decode_step_s=0.06), tpot, 2048) == 64  # over it: the least
    assert prefill_chunk_tokens(prefill, _stats(decode_step_s=0.06), tpot, 32) == 32


def test_a_disaggregated_pair_under_a_tpot_objective_retunes_its_prefill_chunk() -> None:
    slo = Slo(ttft_s=60.0, tpot_s=60.0)  # admits everything; the manager still retunes on each request
    engine_config = EngineConfig(num_kv_blocks=128)
    with launch("tiny", engines=2, engine_config=engine_config, manager_config=ManagerConfig(slo=slo),
                disaggregate=True) as s:  # fmt: skip
        [pair] = s.engines
        assert isinstance(pair, DisaggregatedEngine) and pair.prefill_chunk == pair.max_prefill_chunk == 2048
        asked: list[float] = []
        tune = pair.tune_prefill_chunk

        async def recording(tpot_s: float) -> int:
            asked.append(tpot_s)
            return await tune(tpot_s)

        pair.tune_prefill_chunk = recording  # type: ignore[method-assign]
        for i in range(3):  # these also measure both engines' speeds
            r = httpx.post(f"{s.url}/v1/completions", json={"prompt": f"{i} {PROMPT}", "max_tokens": 4})
            assert r.status_code == 200, r.text
        assert asked == [slo.tpot_s] * 3
        assert pair.prefill_chunk == 2048  # a generous objective leaves the chunk whole
        # A tight one (1 ms per output token, below any CPU step here) takes it to its least.
        assert s.run(tune(1e-3)) == pair.prefill_chunk == 64
        assert pair.prefill.core.scheduler.max_num_batched_tokens == 64  # the engine's own budget now
        r = httpx.post(f"{s.url}/v1/completions", json={"prompt": PROMPT * 4, "max_tokens": 4}, timeout=60)
        assert r.status_code == 200, r.text  # a long prompt fills in chunks of 64 and answers
        assert s.run(tune(slo.tpot_s)) == pair.prefill_chunk == 2048  # and back when the objective allows
