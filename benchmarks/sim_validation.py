"""Simulator validation: the simulated engine's time vs the real engine's, on the same small workloads.

The simulator (`server.sim`) is only as good as its latency model, so this benchmark checks it: fit the
model to our real engine, then run application-shaped workloads both on the real
engine (wall clock) and on a `SimEngine` with the fitted model (virtual clock), and compare.

1. **Calibrate**: the model (``--model``: SmolLM2 in the runner's runs, in the engine's own dtype) on the real
   engine with step tracing runs a sweep of batch
   shapes (`server.sim.calibrate.calibrate`: batch 1-16 x prompts 32-384 tokens, prefill then decode);
   `fit_latency_model` fits per-step time to the step features (non-negative least squares).
2. **Validate** on workloads the fit never saw (`validation_workload`: a shared prefix context forked by
   parallel calls that each generate, then one call over all their outputs), in several shapes. Each shape
   runs ``--repeats`` times on the real engine (median wall time) and once on the simulated engine (the
   simulation is deterministic). The work done must be identical (prefill and decode token counts: the
   same engine bookkeeping runs in both); the time may differ by at most ``TOLERANCE``.

    python -m benchmarks.sim_validation [--quick] [--model NAME] [--repeats N] [--json PATH]

Last line: ``RESULT sim_validation max_error=... tolerance=... within=1|0 ...`` (error = |sim - real| /
real per shape; ``fit_error``: the same over the calibration steps' summed time).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from dataclasses import asdict
from pathlib import Path

if not __package__:
    sys.path[0] = str(Path(__file__).resolve().parents[1])  # benchmarks/kernels.py would shadow `kernels`

from benchmarks.harness.flags import add_engine_flags, add_size_flags, set_threads
from benchmarks.harness.machine import load_average, machine_info
from benchmarks.harness.output import fmt_num, log, markdown_table, result_line, write_json
from benchmarks.harness.stats import Spread, safe_ratio
from server.engine import EngineConfig, LLMEngine
from server.sim import SimEngine, fit_latency_model, run, tiny_tokenizer
from server.sim.calibrate import WorkloadResult, calibrate, validation_workload
from server.sim.cluster import sim_model_config

NAME = "sim_validation"
TOLERANCE = 0.25  # the stated agreement: simulated time within 25% of the real engine's median
# (prefix_len, calls, call_len, new_tokens) of each validation workload
SHAPES = [(256, 8, 96, 24), (512, 16, 64, 32), (128, 4, 300, 48)]
QUICK_SHAPES = SHAPES[:2]
TINY_SHAPES = [(32, 2, 16, 4)]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_size_flags(p, "two shapes, 3 repeats")
    add_engine_flags(p)
    p.add_argument(
        "--repeats", type=int, default=None, help="real-engine runs per shape (default 5; 3 quick)"
    )
    return p.parse_args(argv)


async def measure_real(
    engine: LLMEngine, shapes: list[tuple[int, int, int, int]], repeats: int
) -> list[list[WorkloadResult]]:
    out = []
    for prefix_len, calls, call_len, new_tokens in shapes:
        await validation_workload(engine, prefix_len=prefix_len, calls=calls, call_len=call_len)  # warm-up
        runs = [
            await validation_workload(
                engine, prefix_len=prefix_len, calls=calls, call_len=call_len, new_tokens=new_tokens
            )
            for _ in range(repeats)
        ]
        out.append(runs)
    return out


async def measure_sim(engine: SimEngine, shapes: list[tuple[int, int, int, int]]) -> list[WorkloadResult]:
    return [
        await validation_workload(engine, prefix_len=p, calls=c, call_len=n, new_tokens=t)
        for p, c, n, t in shapes
    ]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    set_threads(args)
    repeats = args.repeats or (1 if args.tiny else 3 if args.quick else 5)
    shapes = TINY_SHAPES if args.tiny else QUICK_SHAPES if args.quick else SHAPES
    # The tiny harness check fits to a few short steps: enough to run the fit, not to trust it.
    sweep = {"batch_sizes": (1, 2), "prompt_lens": (16, 48), "new_tokens": 4} if args.tiny else {}
    started = time.perf_counter()
    machine = machine_info()
    config = EngineConfig(trace_steps=100_000)
    log(f"calibrating the real engine ({args.model}) ...")
    with LLMEngine.from_pretrained(args.model, config) as engine:
        records = asyncio.run(calibrate(engine, **sweep))
        stats = engine.stats()
        model = fit_latency_model(
            records,
            f"cpu-{engine.model_name}-fitted",
            kv_tokens=stats.blocks_total * stats.block_size,
            max_model_len=engine.max_model_len,
            source=f"fitted in this run to {len(records)} traced steps of the real engine "
            f"({engine.model_name}, CPU)",
        )
        log(f"fitted: {model}")
        log(f"validating on {len(shapes)} workload shapes x {repeats} real runs ...")
        real = asyncio.run(measure_real(engine, shapes, repeats))
    fit_error = abs(
        safe_ratio(sum(model.seconds(r.features) for r in records), sum(r.seconds for r in records)) - 1
    )
    sim_engine_config = EngineConfig(device="cpu", num_kv_blocks=stats.blocks_total)

    async def simulate() -> list[WorkloadResult]:
        sim = SimEngine(model, tiny_tokenizer(), sim_model_config(model), sim_engine_config)
        try:
            return await measure_sim(sim, shapes)
        finally:
            sim.shutdown()

    simulated = run(simulate())
    rows, errors, same_work = [], [], True
    for shape, runs, sim in zip(shapes, real, simulated, strict=True):
        spread = Spread.of(r.seconds for r in runs)
        error = abs(safe_ratio(sim.seconds, spread.median) - 1)
        errors.append(error)
        work = (runs[0].prefill_tokens, runs[0].decode_tokens) == (sim.prefill_tokens, sim.decode_tokens)
        same_work &= work
        rows.append(
            [
                "prefix {}, {} calls x {} tokens, {} new".format(*shape),
                f"{spread.median * 1000:.0f} ± {spread.rel_half_range:.0%}",
                f"{sim.seconds * 1000:.0f}",
                f"{error:.1%}",
                f"{fmt_num(sim.prefill_tokens)}/{fmt_num(sim.decode_tokens)}"
                + ("" if work else " (differs!)"),
            ]
        )
    total_s = time.perf_counter() - started
    print(f"# {NAME}: simulated vs real engine time ({args.model}; load average {load_average()})")
    print(f"machine: {machine['cpu_model']} ({machine['usable_cores']} cores), fitted: {asdict(model)}")
    print(
        markdown_table(
            ["workload", "real ms (median)", "sim ms", "error", "prefill/decode tokens"],
            rows,
            [False, True, True, True, True],
        )
    )
    max_error = max(errors)
    within = max_error <= TOLERANCE and same_work
    print(f"tolerance {TOLERANCE:.0%}: {'within' if within else 'NOT within'}; fit error {fit_error:.1%}")
    metrics: dict[str, float | int] = {
        "max_error": max_error,
        "tolerance": TOLERANCE,
        "within": int(within),
        "same_work": int(same_work),
        "fit_error": fit_error,
        "total_s": total_s,
    }
    if args.json:
        write_json(
            args.json,
            {
                "name": NAME,
                "machine": machine,
                "model": asdict(model),
                "shapes": shapes,
                "real": [[asdict(r) for r in runs] for runs in real],
                "sim": [asdict(s) for s in simulated],
                "metrics": metrics,
            },
        )
    print(result_line(NAME, metrics))


if __name__ == "__main__":
    main()
