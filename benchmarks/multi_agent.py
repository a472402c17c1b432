"""Multi-agent programming (Fig. 18): latency and exact KV memory vs number of files, Parrot vs ablations.

The app (`benchmarks.workloads.multi_agent`): a MetaGPT-like team writes ``files`` files — an architect,
then ``rounds`` rounds of parallel coders, an integrator, parallel reviewers, parallel revisers and a
merger (``1 + rounds * (3 * files + 2)`` calls). Every prompt starts with the shared message pool, the
prompt + output of an earlier call, so Parrot forks it instead of prefilling it. Greedy, EOS ignored.

* **parrot** — every call queued in one session, one latency ``aget`` of the last changelog sends the DAG;
  deduction puts each parallel stage in a task group, which may exceed the latency cap.
* **parrot, no sharing** — the same on a manager with ``prefix_sharing=False``: every step fills its prompt.
* **parrot, no deduction** — every step held to the latency cap (``engine_capacity_tokens=cap``), as a
  service that cannot deduce objectives must.
* **baseline** — a LangChain-style client: each stage's prompts rendered client-side, sent as concurrent
  ``/v1/completions``, one round trip per stage; nothing shared, FIFO under the cap on its engine.

Per number of files, on fresh servers, each system's first job is the warm-up, the output check (every
call's output equal to the baseline's) and the exact KV peak (`harness.peaks`; Parrot's includes the
contexts it keeps cached); then ``--repeats`` interleaved jobs per system, without and with the network
delay U(0.2, 0.3) s per request: latency to the final output in the client's hands. **On the simulator**
(``a100-llama7b`` profile, derived, not measured; virtual time, the delay on): the same clients and DAG at
GPU scale (3 rounds, 16 files at ``--quick``, cap 8,192 tokens), one deterministic job per system. Paper
anchor (one A100, LLaMA 13B): up to 11.7x vs the latency-centric baseline, 2.35x from sharing.

    python -m benchmarks.multi_agent [--quick | --tiny] [--json PATH] [--files 2,4,8] [--sim-files 4,8,16]

Last line: ``RESULT multi_agent speedup=... mem_ratio=... files=... speedup_sim=... total_s=...`` at the
largest number of files (``speedup*``: that system's median latency over Parrot's, with the delay unless
``_nodelay``; ``*_sim``: the simulator's, at its largest number of files).
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from benchmarks.harness import dag_sweeps, first_jobs, payload_plots, record, systems
from benchmarks.harness.flags import int_list
from benchmarks.harness.systems import System
from benchmarks.plotting import pyplot, save
from benchmarks.workloads.multi_agent import Budgets, Workflow, make_workflow, project_brief, stage_roles
from server.engine import EngineConfig
from server.serve.manager import ManagerConfig

NAME = "multi_agent"
PARROT, BASELINE = "parrot", "baseline"
NO_SHARING, NO_DEDUCTION = "parrot, no sharing", "parrot, no deduction"
CLIENTS = (PARROT, NO_SHARING, NO_DEDUCTION, BASELINE)
# The baseline's first job runs first: its outputs are the check. Ratios are to Parrot's.
COMPARISON = dag_sweeps.Comparison(CLIENTS, baseline=BASELINE, reference=PARROT, unit="files")
PAPER_ANCHOR = {
    "speedup_vs_baseline_max": 11.7,  # Fig. 18a, 16 files, latency-centric baseline
    "speedup_vs_throughput_baseline_max": 2.45,
    "speedup_from_sharing": 2.35,
    "note": "Fig. 18b: Parrot without sharing hits the GPU memory ceiling",
}
# A GPU engine's prefill chunk and batch limit; the KV cache is the profile's (64k tokens).
SIM_ENGINE = EngineConfig(device="cpu", max_num_batched_tokens=4096, max_num_seqs=256)


@dataclass(frozen=True)
class SimConfig:
    files: tuple[int, ...] = (4, 8, 16)
    rounds: int = 3  # the paper's
    brief_tokens: int = 256
    budgets: Budgets = field(default_factory=lambda: Budgets(128, 48, 16, 24, 16))
    # Admits the longest request (~7,900 tokens at 16 files), one late request at a time, as the paper's
    # 4,096 did for its prompts.
    latency_cap_tokens: int = 8192
    profile: str = "a100-llama7b"


@dataclass(frozen=True)
class BenchConfig:
    files: tuple[int, ...] = (2, 4, 8)
    rounds: int = 3
    brief_tokens: int = 256  # the project brief at the head of every prompt
    budgets: Budgets = field(default_factory=Budgets)
    # Admits the largest request (checked), and one or two of the long late prompts at once at 8 files.
    latency_cap_tokens: int = 4096
    num_kv_blocks: int = 2048  # 16-token blocks: room for a whole stage of 8 files at once
    repeats: int = 3
    seed: int = 0
    sim: SimConfig = field(default_factory=SimConfig)


FULL = BenchConfig()  # Budgets(design, code, notes, review, changelog) below
_QUICK_JOB: dict[str, Any] = {"rounds": 1, "brief_tokens": 128, "budgets": Budgets(16, 16, 8, 8)}
# The headline points only: the metrics are the largest file count's (2 files cost ~70 s of the quick set).
QUICK = BenchConfig((4,), **_QUICK_JOB, latency_cap_tokens=1024, num_kv_blocks=1024, repeats=2)
QUICK = replace(QUICK, sim=SimConfig(files=(16,)))
_TINY_JOB: dict[str, Any] = {"rounds": 1, "brief_tokens": 32, "budgets": Budgets(4, 4, 2, 2, 2)}
_TINY_JOB["latency_cap_tokens"] = 512
TINY = BenchConfig((2,), **_TINY_JOB, num_kv_blocks=256, repeats=1, sim=SimConfig((2,), **_TINY_JOB))


def make_job(sizes: BenchConfig | SimConfig, seed: int, tokenizer: Any, files: int) -> Workflow:
    """The workflow for ``files`` files at these sizes, its brief in ``tokenizer``'s tokens."""
    brief = project_brief(tokenizer, sizes.brief_tokens, seed)
    return make_workflow(brief, files, sizes.rounds, seed, sizes.budgets)


def compared(engine: EngineConfig, cap: int) -> list[System]:
    """The four systems around one engine config and latency ``cap``; no prefix cache on OpenAI routes."""
    manager = ManagerConfig(latency_cap_tokens=cap, openai_prefix_cache=False)
    return [
        System(PARROT, engine, manager),
        System(NO_SHARING, engine, replace(manager, prefix_sharing=False)),
        System(NO_DEDUCTION, engine, replace(manager, engine_capacity_tokens=cap)),
        replace(systems.baseline(BASELINE, engine, cap=cap), manager=manager),
    ]


Point = dag_sweeps.Point[Workflow]  # one number of files


# ----------------------------------------------------------------------------------------------- report
def describe(what: str, sizes: BenchConfig | SimConfig, points: list[Point]) -> str:
    shapes = "; ".join(f"{p.size} files: {len(p.dag.calls)} calls, longest {p.longest}" for p in points)
    return (
        f"{what}: architect, then {sizes.rounds} rounds of coders / integrator / reviewers / revisers / "
        f"merger; brief {sizes.brief_tokens} tokens, output tokens {asdict(sizes.budgets)} (greedy, EOS "
        f"ignored); latency cap {sizes.latency_cap_tokens} running tokens. {shapes} (prompt + max_tokens "
        "tokens). Every call's output identical across the systems (checked).\n"
    )


def print_report(rec: record.Recorder, cfg: BenchConfig, points: list[Point], sims: list[Point]) -> None:
    print(rec.header(rec.args.model))
    print(describe("MetaGPT-like job", cfg, points))
    print(
        f"Latency: median of {cfg.repeats} jobs per system after the first, ± half the range; speedup: that "
        "system's latency over Parrot's. Engine columns: medians per job.\n"
    )
    settings = [row for p in points for row in p.runs.latency_rows(f"{p.size}, ")]
    print(record.latency_table(settings, "files, network delay") + "\n")
    print(describe(f"Simulator ({cfg.sim.profile}, network delay, one job per system)", cfg.sim, sims))
    print("Each system's first job on a fresh server (16-token KV blocks, exact peak):\n")
    both = (("", points), (" (simulator)", sims))
    print(first_jobs.table([(f"{p.size}{at}", p.runs) for at, ps in both for p in ps], "files") + "\n")
    print(
        f"paper anchor (Fig. 18, one A100, LLaMA 13B): up to {PAPER_ANCHOR['speedup_vs_baseline_max']}x vs "
        f"the latency-centric baseline, {PAPER_ANCHOR['speedup_from_sharing']}x from sharing."
    )


def result_metrics(points: list[Point], sims: list[Point]) -> dict[str, float | int]:
    """At the largest number of files (NaN for a setting not measured: the keys are always the same), then
    the simulator's at its largest."""
    p, sr = max(points, key=lambda q: q.size), max(sims, key=lambda q: q.size)
    real, sim = p.runs, sr.runs
    settings = (("", True), ("_nodelay", False))  # (key suffix, network delay)
    ablations = (("nosharing", NO_SHARING), ("nodeduction", NO_DEDUCTION))
    return {
        "speedup": real.speedup(True, BASELINE),
        "speedup_nodelay": real.speedup(False, BASELINE),
        **{f"speedup_vs_{a}{s}": real.speedup(d, name) for s, d in settings for a, name in ablations},
        "mem_ratio": real.over(BASELINE, "peak_blocks"),
        "mem_ratio_nosharing": real.over(NO_SHARING, "peak_blocks"),
        "parrot_peak_blocks": real.cold[PARROT].peak_blocks,
        "baseline_peak_blocks": real.cold[BASELINE].peak_blocks,
        **{f"{name}{s}_s": real.median_s(d, name) for s, d in settings for name in (PARROT, BASELINE)},
        "files": p.size,
        "speedup_sim": sim.over(BASELINE, "seconds"),
        "speedup_sim_no_sharing": sim.over(NO_SHARING, "seconds"),
        "speedup_sim_no_deduction": sim.over(NO_DEDUCTION, "seconds"),
        "parrot_sim_s": sim.cold[PARROT].seconds,
        "baseline_sim_s": sim.cold[BASELINE].seconds,
        "files_sim": sr.size,
    }


def point_payload(p: Point) -> dict[str, Any]:
    """One number of files for the JSON payload: the job's shape, the first jobs, the timed settings."""
    shape = {"files": p.size, "calls": len(p.dag.calls), "stages": stage_roles(p.dag)}
    return {**shape, "longest_request_tokens": p.longest, **p.runs.payload()}


# ----------------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> None:
    p = record.parser(
        __doc__,
        "4 files, 1 round, short outputs, 2 repeats; the simulator at 16 files (~2 min)",
        BenchConfig,
        repeats="timed jobs per system and setting",
        rounds="review rounds (paper: 3)",
        brief_tokens="tokens of the project brief",
        latency_cap_tokens="latency cap in running tokens (every system)",
    )
    p.add_argument("--files", type=int_list, help="numbers of files to sweep, e.g. 2,4,8")
    p.add_argument("--sim-files", type=int_list, help="numbers of files to simulate, e.g. 4,8,16")
    p.add_argument("--no-delay-only", action="store_true", help="measure without the network delay only")
    args = p.parse_args(argv)
    cfg = record.configured(args, FULL, QUICK, TINY)
    if args.sim_files is not None:
        cfg = replace(cfg, sim=replace(cfg.sim, files=args.sim_files))
    if not cfg.files or not cfg.sim.files:
        p.error("--files and --sim-files take at least one number of files")
    rec = record.Recorder(NAME, args)
    delays = [False] if args.no_delay_only else [False, True]
    cap = cfg.latency_cap_tokens
    setup = compared(EngineConfig(num_kv_blocks=cfg.num_kv_blocks), cap)
    real_job = functools.partial(make_job, cfg, cfg.seed)
    points = COMPARISON.sweep(
        args.model, setup, cfg.files, real_job, cap, repeats=cfg.repeats, delays=delays, seed=cfg.seed
    )
    from server.sim import load_profile, tiny_tokenizer

    sim, sim_setup = cfg.sim, compared(SIM_ENGINE, cfg.sim.latency_cap_tokens)
    sim_job = functools.partial(make_job, sim, cfg.seed, tiny_tokenizer())
    sims = COMPARISON.simulated(sim_setup, sim.profile, sim.files, sim_job, sim.latency_cap_tokens, cfg.seed)
    print_report(rec, cfg, points, sims)
    rec.finish(
        result_metrics(points, sims),
        config=cfg,
        model=args.model,
        systems={s.name: s.describe() for s in setup},
        outputs_identical=True,
        by_files=[point_payload(p) for p in points],
        simulator={
            "profile": asdict(load_profile(cfg.sim.profile)),
            "systems": {s.name: s.describe() for s in sim_setup},
            "by_files": [point_payload(s) for s in sims],
        },
        paper_anchor=PAPER_ANCHOR,
    )


# ----------------------------------------------------------------------------------------------- plot
def plot(payload: dict[str, Any], path: Path) -> None:
    """Fig. 18: latency vs files per system (the delay setting where measured), the exact KV peak vs files,
    and the simulated latency vs files."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.2))
    rows = payload["by_files"]
    delay = payload_plots.compared_sweep(axes, rows, payload["simulator"]["by_files"], "files", CLIENTS)
    files = sorted(r["files"] for r in rows)
    title = "latency" + (" (network delay 0.2-0.3 s)" if delay else " (no network delay)")
    axes[0].set(xlabel="files", ylabel="end-to-end latency (s)", title=title, xticks=files)
    axes[1].set(xlabel="files", ylabel="peak KV blocks in use", title="KV memory (exact peak)", xticks=files)
    profile = payload["config"]["sim"]["profile"]
    axes[2].set(xlabel="files", ylabel="latency (simulated s)", title=f"simulator ({profile}, delay)")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"multi-agent programming ({payload.get('model', '')})")
    save(fig, path)


if __name__ == "__main__":
    main()
