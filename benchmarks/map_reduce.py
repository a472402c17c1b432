"""Map-reduce summary of a long document: Parrot vs a latency-capped request-centric baseline (Fig. 14).

The app: a long document (stdlib docstrings) cut into ``chunks`` parts of ``chunk_tokens`` tokens; one *map*
call per part writes its summary (``map_tokens``), then one *reduce* call reads every summary and writes the
whole document's (``reduce_tokens``). Greedy, EOS ignored: every call writes exactly its budget.

* **parrot** — the `parrot` frontend: the map calls and the reduce call are queued in one session and one
  ``aget(criteria=P.LATENCY)`` of the reduce output sends the DAG in one batch. Deduction puts the map calls
  in one task group, placed together as one large batch; the manager's latency cap binds only the reduce.
* **baseline** — what a LangChain app does against an OpenAI-style service: concurrent
  ``/v1/completions`` for the map prompts it renders, then the reduce. Its engine admits FIFO under the
  latency cap (`EngineConfig.max_running_tokens`, the paper's 4096 on an A100, scaled here so only a few map
  requests run at once).

Same engine code and configuration otherwise, two in-process servers; the final summaries must be identical
before anything is timed. Latency = first request to the final summary in the client's hands; medians over
``--repeats`` interleaved runs after a warm-up, ± half the range, without and with the client network delay
U(0.2, 0.3) s per request. On a CPU a decode step costs about the same for 2 or 16 sequences (per-step
overhead), much as on a GPU, so the speedup follows the ratio of engine steps (shown).

**At GPU scale, on the simulator**: the same two clients over one simulated engine with the ``a100-llama7b``
profile (derived from a datasheet roofline, not measured), the paper's setting: ``sim_chunks`` x 1024-token
parts, 50- and 100-token map summaries, cap 4096, the same delay; deterministic, outputs checked too.

    python -m benchmarks.map_reduce [--quick] [--json PATH] [--repeats N] [--chunks N] ...

Last line: ``RESULT map_reduce speedup=... speedup_nodelay=... parrot_s=... baseline_s=... ...
sim_speedup_out50=... sim_speedup_out100=... total_s=...`` (speedup: baseline over Parrot median latency).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.harness import app_jobs, job_runs, measure, record, systems
from benchmarks.harness.output import log
from benchmarks.harness.stats import safe_ratio
from benchmarks.harness.systems import Served
from benchmarks.plotting import pyplot, save
from benchmarks.workloads.map_reduce_app import MAP_TEMPLATE, MapReduceDoc, make_doc
from server.engine import EngineConfig

NAME = "map_reduce"
PARROT, BASELINE = "parrot", "baseline"
CLIENTS = (PARROT, BASELINE)
PAPER_ANCHOR = 2.37  # Fig. 14: one A100 engine, LLaMA 13B, baseline capped at 4096 running tokens
SIM_OUTPUT_TOKENS = (50, 100)  # map summary lengths simulated


@dataclass(frozen=True)
class BenchConfig:
    chunks: int = 16  # map calls
    chunk_tokens: int = 256  # document tokens per map call
    map_tokens: int = 48
    reduce_tokens: int = 48
    # ~3 map requests (~330 tokens each) fit under it, and so does the reduce request.
    latency_cap_tokens: int = 1024
    num_kv_blocks: int = 1024  # per engine, 16-token blocks: room for every map request at once
    repeats: int = 5
    seed: int = 0
    # The GPU-scale job on the simulator.
    sim_chunks: int = 32
    sim_chunk_tokens: int = 1024
    sim_cap: int = 4096
    profile: str = "a100-llama7b"


FULL = BenchConfig()
QUICK = BenchConfig(chunks=8, latency_cap_tokens=768, repeats=2, sim_chunks=16)
TINY = BenchConfig(chunks=2, chunk_tokens=16, map_tokens=4, reduce_tokens=4, repeats=1, sim_chunks=2)


# ----------------------------------------------------------------------------------------------- clients
def job(served: Served, doc: MapReduceDoc) -> measure.Job:
    """The system's client as a harness job: Parrot's through the `parrot` frontend, the baseline's
    request by request."""
    return app_jobs.map_reduce(served, doc, parrot=served.system.name == PARROT)


def compared(engine: EngineConfig, cap: int) -> list[systems.System]:
    """Parrot with ``cap`` as its latency cap; the baseline's engine capped at ``cap`` running tokens."""
    return [
        systems.parrot(PARROT, engine, latency_cap_tokens=cap),
        systems.baseline(BASELINE, engine, cap=cap),
    ]


# ----------------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> None:
    p = record.parser(
        __doc__,
        "8 map calls, 2 repeats (~1 min)",
        BenchConfig,
        repeats="timed jobs per client and setting",
        chunks="map calls",
        profile="the simulator's latency profile: a name under server/sim/profiles or a JSON file",
        chunk_tokens="document tokens per part",
        map_tokens="summary tokens per map call",
        reduce_tokens="tokens of the final summary",
        latency_cap_tokens="latency cap in running tokens (both servers)",
        sim_chunks="map calls of the simulated GPU-scale job",
    )
    p.add_argument("--no-delay-only", action="store_true", help="measure without the network delay only")
    args = p.parse_args(argv)
    cfg = record.configured(args, FULL, QUICK, TINY)
    rec = record.Recorder(NAME, args)
    cap = cfg.latency_cap_tokens
    setup = compared(EngineConfig(num_kv_blocks=cfg.num_kv_blocks), cap)
    log(f"starting two servers ({args.model}): parrot, and the baseline capped at {cap} ...")
    with systems.serve(args.model, setup, seed=cfg.seed) as servers:
        tokenizer = servers[PARROT].tokenizer
        doc = make_doc(tokenizer, cfg.chunks, cfg.chunk_tokens, cfg.map_tokens, cfg.reduce_tokens)
        map_request = max(len(tokenizer.encode(doc.map_prompt(c))) for c in doc.chunks) + cfg.map_tokens
        if map_request > cap:
            raise SystemExit(
                f"a map request ({map_request} tokens) exceeds the cap: raise --latency-cap-tokens"
            )
        delays = (False,) if args.no_delay_only else (False, True)
        log(f"verifying outputs and warming up ({cfg.chunks} map calls) ...")
        timed = asyncio.run(
            job_runs.delay_settings(servers, lambda s: job(s, doc), cfg.repeats, PARROT, delays)
        )
    sims = {out: run_simulation(cfg, out) for out in SIM_OUTPUT_TOKENS}

    print(rec.header(args.model))
    print(
        f"{cfg.chunks} map calls over parts of {cfg.chunk_tokens} tokens, {cfg.map_tokens} tokens each, "
        f"then a reduce call writing {cfg.reduce_tokens}; greedy, EOS ignored. Latency cap {cap} tokens "
        f"(baseline engine's FIFO cap, Parrot's latency cap): {cap // map_request} map requests of "
        f"{map_request} tokens fit under it. Median of {cfg.repeats} jobs per client after a warm-up; "
        "summaries identical (checked). Engine columns: medians per job.\n"
    )
    print(record.latency_table(timed.latency_rows("")) + "\n")
    print(
        f"simulator ({cfg.profile}, {cfg.sim_chunks} x {cfg.sim_chunk_tokens}-token parts, "
        f"cap {cfg.sim_cap}):"
    )
    for out, runs in sims.items():
        line = ", ".join(f"{n} {r.seconds:.2f} s ({r.engine['steps']} steps)" for n, r in runs.items())
        print(f"  {out}-token summaries: {line}: {sim_speedup(runs):.2f}x")
    print(f"paper anchor (Fig. 14, one A100): {PAPER_ANCHOR}x")

    metrics = {
        "speedup": timed.speedup(True, BASELINE),
        "speedup_nodelay": timed.speedup(False, BASELINE),
        **{
            f"{n}{suffix}_s": timed.median_s(d, n)
            for suffix, d in (("", True), ("_nodelay", False))
            for n in CLIENTS
        },
        **{f"sim_speedup_out{out}": sim_speedup(runs) for out, runs in sims.items()},
        **{f"sim_{n}_out{out}_s": runs[n].seconds for n in CLIENTS for out, runs in sims.items()},
    }
    rec.finish(
        metrics,
        config=cfg,
        model=args.model,
        systems={s.name: s.describe() for s in setup},
        templates={"map": MAP_TEMPLATE, "reduce": doc.reduce_template},
        settings=timed.payload()["settings"],
        simulator={
            str(o): {n: {"seconds": r.seconds, **r.engine} for n, r in runs.items()}
            for o, runs in sims.items()
        },
        paper_anchor=PAPER_ANCHOR,
    )


def sim_speedup(runs: dict[str, measure.Run]) -> float:
    return safe_ratio(runs[BASELINE].seconds, runs[PARROT].seconds)


def run_simulation(cfg: BenchConfig, map_tokens: int) -> dict[str, measure.Run]:
    """Each client once on a simulated GPU engine (virtual seconds); outputs checked equal."""
    from server.sim import tiny_tokenizer

    log(f"simulating the GPU-scale job ({cfg.sim_chunks} parts, {map_tokens}-token summaries) ...")
    doc = make_doc(tiny_tokenizer(), cfg.sim_chunks, cfg.sim_chunk_tokens, map_tokens, 100)
    # 4096 tokens per step, like a GPU engine's prefill chunk; the caps are what differs between clients.
    engine = EngineConfig(device="cpu", max_num_batched_tokens=4096, max_num_seqs=256)
    return job_runs.simulated_once(compared(engine, cfg.sim_cap), cfg.profile, lambda s: job(s, doc))


def plot(payload: dict[str, Any], path: Path) -> None:
    """Fig. 14: job latency per client and setting on the real engine (left), the simulated GPU job per
    summary length (right)."""
    plt = pyplot()
    fig, (real, sim) = plt.subplots(1, 2, figsize=(9, 3.4))
    settings = payload["settings"]
    for i, client in enumerate(CLIENTS):
        medians = [s["clients"][client]["latency"]["median"] for s in settings]
        real.bar([x + 0.4 * i for x in range(len(settings))], medians, width=0.4, label=client)
    labels = ["with delay" if s["network_delay"] else "no delay" for s in settings]
    real.set_xticks([x + 0.2 for x in range(len(settings))], labels)
    real.set_ylabel("job latency (s, CPU)")
    real.set_title(f"real engine ({payload.get('model', '')})", fontsize=9)
    outs = sorted(payload.get("simulator", {}), key=int)
    for i, client in enumerate(CLIENTS):
        secs = [payload["simulator"][o][client]["seconds"] for o in outs]
        sim.bar([x + 0.4 * i for x in range(len(outs))], secs, width=0.4, label=client)
    sim.set_xticks([x + 0.2 for x in range(len(outs))], [f"{o}-token summaries" for o in outs])
    sim.set_ylabel("job latency (simulated s)")
    sim.set_title("simulator (GPU profile)", fontsize=9)
    for ax in (real, sim):
        ax.legend(fontsize=8)
    save(fig, path)


if __name__ == "__main__":
    main()
