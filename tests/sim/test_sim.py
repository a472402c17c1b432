"""The simulator: virtual time, the simulated engine against the real one, the latency model, and the real
manager + app driven at simulated scale."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import parrot as P
import pytest

from server.engine import EngineConfig, LLMEngine, SamplingParams
from server.engine.step_features import StepFeatures, StepRecord
from server.serve.manager import ManagerConfig
from server.sim import (
    LatencyModel,
    SimEngine,
    SimulationStalledError,
    fit_latency_model,
    load_profile,
    profile_names,
    run,
    sim_cluster,
    tiny_tokenizer,
)
from server.sim.calibrate import calibrate, validation_workload
from server.sim.cluster import sim_model_config

MODEL = LatencyModel(
    "test", base=0.01, prefill_token=1e-4, prefill_pair=1e-8, decode_seq=2e-4, kv_token=1e-6, kv_tokens=8192
)


def sim_engine(model: LatencyModel = MODEL, **config: object) -> SimEngine:
    return SimEngine(model, tiny_tokenizer(), sim_model_config(model), EngineConfig(device="cpu", **config))


# ------------------------------------------------------------------------------------------ virtual time
def test_virtual_time_passes_instantly_and_in_order() -> None:
    async def main() -> tuple[list[float], float]:
        loop = asyncio.get_running_loop()

        async def wake(after: float) -> float:
            await asyncio.sleep(after)
            return loop.time()

        woke = await asyncio.gather(wake(3600), wake(5), wake(1))
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(asyncio.sleep(100), 10)
        return woke, loop.time()

    started = time.perf_counter()
    woke, now = run(main())
    assert woke == [3600.0, 5.0, 1.0]
    assert now == 3610.0
    assert time.perf_counter() - started < 5  # an hour and more of simulated time, at once


def test_executor_work_stops_the_clock() -> None:
    """A thread's work counts as no simulated time, and no timer fires early while it runs."""

    async def main() -> tuple[float, bool]:
        loop = asyncio.get_running_loop()
        timer = asyncio.ensure_future(asyncio.sleep(10))
        await asyncio.to_thread(time.sleep, 0.05)
        return loop.time(), timer.done()

    now, fired = run(main())
    assert now == 0.0 and not fired


def test_a_deadlock_is_reported_not_hung(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("server.sim.clock._STALL_TIMEOUT_S", 0.05)

    async def main() -> None:
        await asyncio.get_running_loop().create_future()  # nobody will ever set it

    with pytest.raises(SimulationStalledError, match="stuck"):
        run(main())


# ------------------------------------------------------------------------------------------ latency model
def test_fit_recovers_the_coefficients_of_a_known_model() -> None:
    grid = [(0, 0, 1, 100), (0, 0, 8, 400), (0, 0, 32, 900), (512, 0, 0, 0), (128, 256, 4, 300)]
    grid += [(2048, 1024, 0, 0), (64, 0, 16, 50), (0, 0, 64, 2000), (300, 100, 2, 10)]
    shapes = [StepFeatures(p, p * (p + 1) // 2 + p * c, d, d * k, d * k // 3) for p, c, d, k in grid]
    records = [StepRecord(f, MODEL.seconds(f)) for f in shapes]
    fitted = fit_latency_model(
        records, "refit", kv_tokens=8192, max_model_len=4096, shared_prefix_decode=True
    )
    for name in ("base", "prefill_token", "prefill_pair", "decode_seq", "kv_token"):
        assert getattr(fitted, name) == pytest.approx(getattr(MODEL, name), rel=1e-6), name


def test_fit_needs_enough_steps_and_profiles_load_by_name() -> None:
    with pytest.raises(ValueError, match="at least 5"):
        fit_latency_model([], "x", kv_tokens=1, max_model_len=1)
    assert "a100-llama7b" in profile_names()
    gpu = load_profile("a100-llama7b")
    assert gpu.kv_tokens == 65536 and gpu.source.startswith("derived, not measured")
    with pytest.raises(FileNotFoundError, match="a100-llama7b"):
        load_profile("h900")


def test_shared_prefix_reads_count_once_only_with_the_kernel() -> None:
    f = StepFeatures(decode_seqs=8, decode_kv_tokens=8 * 1000, decode_kv_shared=7 * 960)
    with_kernel = MODEL.seconds(f)
    without = dataclasses.replace(MODEL, shared_prefix_decode=False).seconds(f)
    assert without - with_kernel == pytest.approx(7 * 960 * MODEL.kv_token)


# ------------------------------------------------------------------------------------------ the engines
def test_the_real_engine_traces_its_steps() -> None:
    with LLMEngine.from_pretrained("tiny", EngineConfig(trace_steps=1000, device="cpu")) as engine:
        sweep = {"batch_sizes": (1, 3), "prompt_lens": (20, 40), "new_tokens": 4}
        records = asyncio.run(calibrate(engine, **sweep, warmup=False))
        stats = engine.stats()
    assert len(records) == stats.steps
    assert sum(r.features.prefill_tokens for r in records) == stats.prefill_tokens_computed
    # One-token chunks are decodes: every generated token but each generate's first (sampled at the end
    # of its prompt's fill) is decoded once.
    assert sum(r.features.decode_seqs for r in records) == stats.decode_tokens_computed
    assert all(r.seconds > 0 for r in records)


def test_calibration_traces_the_sweep_after_an_untraced_warmup() -> None:
    """The warm-up runs every shape first (one-time costs stay out of the fit); the trace then holds the very
    steps a cold sweep makes, and only those."""
    sweep = {"batch_sizes": (1, 3), "prompt_lens": (20, 40), "new_tokens": 4}
    with LLMEngine.from_pretrained("tiny", EngineConfig(trace_steps=1000, device="cpu")) as engine:
        cold = asyncio.run(calibrate(engine, **sweep, warmup=False))
    with LLMEngine.from_pretrained("tiny", EngineConfig(trace_steps=1000, device="cpu")) as engine:
        warm = asyncio.run(calibrate(engine, **sweep))
        stats = engine.stats()
    assert [r.features for r in warm] == [r.features for r in cold]
    warmup_steps = stats.steps - len(warm)
    assert warmup_steps >= 4  # each of the four shapes filled and decoded once before
    assert stats.prefill_tokens_computed == 2 * sum(r.features.prefill_tokens for r in warm)


def test_the_simulated_engine_does_exactly_the_real_engines_work() -> None:
    """Same bookkeeping: identical prefill/decode token counts and output lengths on an app-shaped
    workload with a shared prefix forked by parallel calls."""
    with LLMEngine.from_pretrained("tiny", EngineConfig(device="cpu", num_kv_blocks=512)) as engine:
        real = asyncio.run(validation_workload(engine, prefix_len=64, calls=4, call_len=40, new_tokens=8))

    async def simulated() -> object:
        engine = sim_engine(num_kv_blocks=512)
        try:
            return await validation_workload(engine, prefix_len=64, calls=4, call_len=40, new_tokens=8)
        finally:
            engine.shutdown()

    sim = run(simulated())
    assert dataclasses.replace(sim, seconds=0) == dataclasses.replace(real, seconds=0)  # type: ignore[type-var]
    assert real.output_tokens == 5 * 8


def test_simulated_step_times_follow_the_model_and_outputs_do_not_depend_on_batching() -> None:
    async def main() -> tuple[list[list[int]], float, int]:
        engine = sim_engine()
        tok = tiny_tokenizer()
        prompt = tok.encode("a document about engines " * 10)

        async def one(i: int, delay: float) -> list[int]:
            await asyncio.sleep(delay)
            await engine.fill(i, prompt)
            return (await engine.generate(i, SamplingParams(max_tokens=6))).token_ids

        outs = await asyncio.gather(one(1, 0), one(2, 0), one(3, 0.5))
        return outs, engine.busy_seconds, engine.stats().steps

    outs, busy, steps = run(main())
    assert outs[0] == outs[1] == outs[2] and len(outs[0]) == 6
    assert busy > steps * MODEL.base  # every step costs at least the base time


def test_a_dead_simulated_engine_fails_requests_with_a_clear_error() -> None:
    async def main() -> None:
        engine = sim_engine()
        engine.shutdown()
        await engine.fill(1, [5, 6, 7])

    with pytest.raises(Exception, match="not running"):
        run(main())


# ------------------------------------------------------------------------------------------ the cluster
def test_sim_cluster_needs_virtual_time() -> None:
    async def main() -> None:
        async with sim_cluster(1, MODEL):
            pass

    with pytest.raises(RuntimeError, match=r"server\.sim\.run"):
        asyncio.run(main())


def test_a_map_reduce_app_runs_on_the_real_manager_over_simulated_engines() -> None:
    """The parrot client, the HTTP app, the manager, deduction and Algorithm 1 over two simulated engines:
    the map stage is one task group on one engine, the reduce follows; exact placement counts."""
    sampling = P.SamplingConfig(max_tokens=8, ignore_eos=True)
    summarize = P.SemanticFunction.from_template(
        "Summarize: {{input:chunk}} Summary: {{output:summary}}", name="map", sampling=sampling
    )
    combine = P.SemanticFunction.from_template(
        "Combine: " + " ".join(f"{{{{input:s{i}}}}}" for i in range(6)) + " Final: {{output:final}}",
        name="reduce",
        sampling=sampling,
    )

    async def main() -> tuple[str, float, dict[str, int]]:
        config = ManagerConfig(latency_cap_tokens=300)
        async with sim_cluster(2, MODEL, manager_config=config, network_delay=(0.2, 0.3)) as cluster:
            async with P.Session(cluster.url, client=cluster.client) as s:
                parts = [summarize(chunk=s.variable(f"part {i} " * 40)) for i in range(6)]
                final = combine(**{f"s{i}": p for i, p in enumerate(parts)})
                value = await final.aget(criteria=P.LATENCY)
            reasons = {f"{e}/{r}": n for (e, r), n in cluster.manager.placement.placed.items()}
            return value, cluster.now(), reasons

    value, now, reasons = run(main())
    assert len(tiny_tokenizer().encode(value)) >= 6
    # Six maps of ~130 tokens each would not fit a 300-token latency cap together; as a task group they
    # run at full capacity on one engine.
    assert reasons == {"0/task_group": 6, "0/find_engine": 1}
    assert 0.4 < now < 5  # two delayed requests (session, batch) plus the work: seconds, not minutes


def test_h100_profile_is_the_fit_of_its_recorded_trace() -> None:
    """The measured GPU profile is exactly what the latency fit makes of the steps recorded on the H100."""
    import json
    from pathlib import Path

    from server.engine.step_features import StepFeatures, StepRecord
    from server.sim.latency import fit_latency_model, load_profile

    record = json.loads((Path(__file__).parents[2] / "benchmarks/results/gpu.json").read_text())
    trace = [StepRecord(StepFeatures(**s["features"]), s["seconds"]) for s in record["profile_trace"]]
    shipped = load_profile("h100-llama7b")
    fitted = fit_latency_model(
        trace, shipped.name, kv_tokens=shipped.kv_tokens, max_model_len=shipped.max_model_len
    )
    for field in ("base", "prefill_token", "prefill_pair", "decode_seq", "kv_token"):
        assert getattr(fitted, field) == pytest.approx(getattr(shipped, field), rel=1e-6, abs=1e-12)
    # And it predicts the traced model steps it was fitted to: measured 2.4% median error, 7.1% at p90.
    model_steps = [r for r in trace if r.features.prefill_tokens or r.features.decode_seqs]
    errors = sorted(abs(shipped.seconds(r.features) - r.seconds) / r.seconds for r in model_steps)
    assert errors[len(errors) // 2] < 0.05 and errors[int(0.9 * len(errors))] < 0.15
