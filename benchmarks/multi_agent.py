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

import asyncio
import contextlib
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx
import parrot as P

from benchmarks.common import fmt_num, int_list, log, markdown_table, safe_ratio
from benchmarks.harness import measure, peaks, record, systems
from benchmarks.harness.clients import complete, greedy
from benchmarks.harness.systems import Served, System
from benchmarks.plotting import pyplot, save
from benchmarks.workloads.multi_agent import Budgets, Workflow, make_workflow, project_brief, stage_roles
from server.engine import EngineConfig
from server.serve.manager import ManagerConfig

NAME = "multi_agent"
PARROT, BASELINE = "parrot", "baseline"
NO_SHARING, NO_DEDUCTION = "parrot, no sharing", "parrot, no deduction"
CLIENTS = (PARROT, NO_SHARING, NO_DEDUCTION, BASELINE)
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
QUICK = BenchConfig((2, 4), **_QUICK_JOB, latency_cap_tokens=1024, num_kv_blocks=1024, repeats=2)
QUICK = replace(QUICK, sim=SimConfig(files=(16,)))  # the headline point only
_TINY_JOB: dict[str, Any] = {"rounds": 1, "brief_tokens": 32, "budgets": Budgets(4, 4, 2, 2, 2)}
_TINY_JOB["latency_cap_tokens"] = 512
TINY = BenchConfig((2,), **_TINY_JOB, num_kv_blocks=256, repeats=1, sim=SimConfig((2,), **_TINY_JOB))


def make_job(sizes: BenchConfig | SimConfig, tokenizer: Any, files: int, seed: int) -> Workflow:
    """The workflow for ``files`` files at these sizes, its brief in ``tokenizer``'s tokens."""
    brief = project_brief(tokenizer, sizes.brief_tokens, seed)
    return make_workflow(brief, files, sizes.rounds, seed, sizes.budgets)


# ----------------------------------------------------------------------------------------------- clients
async def parrot_multi_agent(
    client: httpx.AsyncClient, workflow: Workflow, done: Callable[[], None], everything: bool = False
) -> dict[str, str]:
    """The job through the `parrot` frontend: every call queued in one session, sent with the latency
    ``aget`` of the final output; ``done()`` when it is in hand. The final output by name, or with
    ``everything`` every call's (fetched after ``done``)."""
    async with P.Session(str(client.base_url), client=client, timeout=600.0):
        made: dict[str, P.Variable] = {}
        for c in workflow.calls:
            sampling = P.SamplingConfig(**greedy(c.max_tokens))
            fn = P.SemanticFunction.from_template(c.template, name=c.output, sampling=sampling)
            out = fn(**{name: made[name] for name in c.inputs})
            assert isinstance(out, P.Variable)
            made[c.output] = out
        values = {workflow.final: await made[workflow.final].aget(criteria="latency")}
        done()
        if everything:
            values.update({name: await var.aget() for name, var in made.items()})
    return values


async def baseline_multi_agent(
    client: httpx.AsyncClient,
    workflow: Workflow,
    done: Callable[[], None],
    everything: bool = False,
    model: str | None = None,
) -> dict[str, str]:
    """The job as a request-centric client runs it: a stage's prompts rendered from the answers so far,
    sent as concurrent ``/v1/completions``, the next stage after all are in (outputs as Parrot's)."""
    values: dict[str, str] = {}
    for stage in workflow.stages:
        prompts = [(workflow.prompt(out, values), workflow.call(out).max_tokens) for out in stage]
        answers = await asyncio.gather(*(complete(client, p, n, model=model) for p, n in prompts))
        values.update(zip(stage, answers, strict=True))
    done()
    return values if everything else {workflow.final: values[workflow.final]}


def job(served: Served, workflow: Workflow, everything: bool = False) -> measure.Job:
    """The system's client as a harness job."""
    if served.system.name == BASELINE:
        model = served.model_name
        return lambda done: baseline_multi_agent(served.http, workflow, done, everything, model)
    return lambda done: parrot_multi_agent(served.http, workflow, done, everything)


def compared(engine: EngineConfig, cap: int) -> list[System]:
    """The four systems around one engine config and latency ``cap``; no prefix cache on OpenAI routes."""
    manager = ManagerConfig(latency_cap_tokens=cap, openai_prefix_cache=False)
    return [
        System(PARROT, engine, manager),
        System(NO_SHARING, engine, replace(manager, prefix_sharing=False)),
        System(NO_DEDUCTION, engine, replace(manager, engine_capacity_tokens=cap)),
        replace(systems.baseline(BASELINE, engine, cap=cap), manager=manager),
    ]


# ----------------------------------------------------------------------------------------------- measuring
@dataclass(frozen=True)
class Cold:
    """A system's first job on a fresh server: seconds and requests until the answer, the engine's work,
    the exact KV peak, evictions, and on the simulator the engine's busy seconds."""

    seconds: float
    requests: int
    engine: dict[str, int]
    peak_blocks: int
    evictions: int
    busy_s: float


@dataclass
class Point:
    """One number of files: the job, its longest request, each system's first job, the timed settings."""

    workflow: Workflow
    final: str  # the final output
    longest: int
    cold: dict[str, Cold]
    settings: dict[bool, dict[str, measure.Samples]] = field(default_factory=dict)  # by network delay

    @property
    def files(self) -> int:
        return len(self.workflow.files)

    def speedups(self, delay: bool) -> dict[str, measure.Ratio]:
        """Each other system's latency over Parrot's."""
        samples = self.settings[delay]
        return {name: measure.ratio(samples[name], samples[PARROT]) for name in CLIENTS[1:]}

    def mem_ratio(self, name: str) -> float:
        return safe_ratio(self.cold[name].peak_blocks, self.cold[PARROT].peak_blocks)

    def sim_ratio(self, name: str) -> float:
        return safe_ratio(self.cold[name].seconds, self.cold[PARROT].seconds)


async def first_job(served: Served, workflow: Workflow) -> tuple[dict[str, str], Cold]:
    """The system's first job: every call's output, and `Cold`; requests counted client-side (the
    simulator's server keeps no count) up to the answer (Parrot then fetches every output)."""
    sent: list[str] = []
    at_answer: list[int] = []

    async def count(request: httpx.Request) -> None:
        sent.append(request.method)

    def answered(done: Callable[[], None]) -> None:
        at_answer.append(len(sent))
        done()

    inner = job(served, workflow, everything=True)
    served.http.event_hooks = {"request": [count]}
    try:
        clock = asyncio.get_running_loop().time  # virtual on the simulator
        run, peak = await peaks.peaked(served, lambda done: inner(lambda: answered(done)), clock)
    finally:
        served.http.event_hooks = {"request": []}
    engine = served.engines[0]
    busy_s = getattr(engine, "busy_seconds", math.nan)
    cold = Cold(run.seconds, at_answer[0], run.engine, peak, engine.stats().evictions, busy_s)
    return run.output, cold


async def first_jobs(
    open_system: Callable[[str], contextlib.AbstractAsyncContextManager[Served]], workflow: Workflow, cap: int
) -> Point:
    """Each system's first job, the baseline's first: its outputs size every prompt (checked against the
    window and ``cap``); every other system's outputs must equal them, else the run stops."""
    cold: dict[str, Cold] = {}
    for name in (BASELINE, PARROT, NO_SHARING, NO_DEDUCTION):
        async with open_system(name) as served:
            got, cold[name] = await first_job(served, workflow)
            if name == BASELINE:
                values = got
                longest = workflow.check_window(served.tokenizer, values, served.engines[0].max_model_len)
                if longest > cap:
                    raise SystemExit(f"the latency cap ({cap}) must admit the longest request ({longest})")
            elif diff := [k for k, v in values.items() if got.get(k) != v]:
                raise SystemExit(
                    f"outputs differ ({name} vs baseline) at {diff[0]} and {len(diff) - 1} more\n"
                    f"  {name}: {got.get(diff[0])!r}\n  baseline: {values[diff[0]]!r}"
                )
    return Point(workflow, values[workflow.final], longest, {name: cold[name] for name in CLIENTS})


async def measure_files(
    servers: dict[str, Served], cfg: BenchConfig, files: int, delays: list[bool]
) -> Point:
    """First jobs (warm-up, output check, KV peaks), then ``repeats`` interleaved jobs per setting."""
    workflow = make_job(cfg, servers[PARROT].tokenizer, files, cfg.seed)
    async with systems.connected(servers, timeout=600):
        log(f"{files} files: {len(workflow.calls)} calls; first jobs (memory, output check) ...")
        point = await first_jobs(
            lambda name: contextlib.nullcontext(servers[name]), workflow, cfg.latency_cap_tokens
        )
        expected = {workflow.final: point.final}
        jobs = {name: (lambda s=s: measure.timed(s, job(s, workflow))) for name, s in servers.items()}
        label = f"{files} files, "
        point.settings.update(await measure.per_delay(servers, jobs, cfg.repeats, expected, delays, label))
    return point


async def simulate_files(cfg: BenchConfig, files: int) -> Point:
    """Each system's one job on its own fresh simulated server (run inside `server.sim.run`)."""
    from server.sim import tiny_tokenizer

    sim = cfg.sim
    workflow = make_job(sim, tiny_tokenizer(), files, cfg.seed)
    by_name = {s.name: s for s in compared(SIM_ENGINE, sim.latency_cap_tokens)}

    def open_system(name: str) -> contextlib.AbstractAsyncContextManager[Served]:
        return systems.simulate(by_name[name], sim.profile, delay=systems.DELAY_S, seed=cfg.seed)

    log(f"simulator ({sim.profile}): {files} files, {len(workflow.calls)} calls ...")
    return await first_jobs(open_system, workflow, sim.latency_cap_tokens)


# ----------------------------------------------------------------------------------------------- report
def first_jobs_table(points: list[Point], sims: list[Point]) -> str:
    """Per files and system, its first job: latency (on the simulator: the figure), requests until the
    answer, the exact KV peak, the engine's work."""
    rows = [
        [
            f"{p.files}{label}",
            name,
            f"{c.seconds:.2f} ({p.sim_ratio(name):.2f}x)",
            str(c.requests),
            f"{c.peak_blocks:,} ({p.mem_ratio(name):.2f}x)",
            f"{c.engine['prefill_tokens_computed']:,}",
            f"{c.engine['steps']:,}",
            str(c.evictions),
            fmt_num(c.busy_s, 2),
        ]
        for label, group in (("", points), (" (simulator)", sims))
        for p in group
        for name, c in p.cold.items()
    ]
    headers = ["files", "system", "latency s (/ parrot)", "requests", "peak KV blocks (/ parrot)"]
    headers += ["prefill tokens", "engine steps", "evictions", "engine busy s"]
    return markdown_table(headers, rows, [False, False, *([True] * 7)])


def describe(what: str, sizes: BenchConfig | SimConfig, points: list[Point]) -> str:
    shapes = "; ".join(f"{p.files} files: {len(p.workflow.calls)} calls, longest {p.longest}" for p in points)
    return (
        f"{what}: architect, then {sizes.rounds} rounds of coders / integrator / reviewers / revisers / "
        f"merger; brief {sizes.brief_tokens} tokens, output tokens {asdict(sizes.budgets)} (greedy, EOS "
        f"ignored); latency cap {sizes.latency_cap_tokens} running tokens. {shapes} (prompt + max_tokens "
        "tokens). Every call's output identical across the systems (checked).\n"
    )


def print_report(
    rec: record.Recorder, cfg: BenchConfig, model: str, points: list[Point], sims: list[Point]
) -> None:
    print(rec.header(model))
    print(describe("MetaGPT-like job", cfg, points))
    print(
        f"Latency: median of {cfg.repeats} jobs per system after the first, ± half the range; speedup: that "
        "system's latency over Parrot's. Engine columns: medians per job.\n"
    )
    settings = [
        (f"{p.files}, {systems.delay_label(d)}", samples, p.speedups(d))
        for p in points
        for d, samples in p.settings.items()
    ]
    print(record.latency_table(settings, "files, network delay") + "\n")
    print(describe(f"Simulator ({cfg.sim.profile}, network delay, one job per system)", cfg.sim, sims))
    print("Each system's first job on a fresh server (16-token KV blocks, exact peak):\n")
    print(first_jobs_table(points, sims) + "\n")
    print(
        f"paper anchor (Fig. 18, one A100, LLaMA 13B): up to {PAPER_ANCHOR['speedup_vs_baseline_max']}x vs "
        f"the latency-centric baseline, {PAPER_ANCHOR['speedup_from_sharing']}x from sharing."
    )


def result_metrics(points: list[Point], sims: list[Point]) -> dict[str, float | int]:
    """At the largest number of files (NaN for a setting not measured: the keys are always the same), then
    the simulator's at its largest."""
    p, sr = max(points, key=lambda q: q.files), max(sims, key=lambda q: q.files)

    def speedup(delay: bool, name: str) -> float:
        return p.speedups(delay)[name].median if delay in p.settings else math.nan

    def median(delay: bool, name: str) -> float:
        return p.settings[delay][name].spread.median if delay in p.settings else math.nan

    return {
        "speedup": speedup(True, BASELINE),
        "speedup_nodelay": speedup(False, BASELINE),
        "speedup_vs_nosharing": speedup(True, NO_SHARING),
        "speedup_vs_nodeduction": speedup(True, NO_DEDUCTION),
        "speedup_vs_nosharing_nodelay": speedup(False, NO_SHARING),
        "speedup_vs_nodeduction_nodelay": speedup(False, NO_DEDUCTION),
        "mem_ratio": p.mem_ratio(BASELINE),
        "mem_ratio_nosharing": p.mem_ratio(NO_SHARING),
        "parrot_peak_blocks": p.cold[PARROT].peak_blocks,
        "baseline_peak_blocks": p.cold[BASELINE].peak_blocks,
        "parrot_s": median(True, PARROT),
        "baseline_s": median(True, BASELINE),
        "parrot_nodelay_s": median(False, PARROT),
        "baseline_nodelay_s": median(False, BASELINE),
        "files": p.files,
        "speedup_sim": sr.sim_ratio(BASELINE),
        "speedup_sim_no_sharing": sr.sim_ratio(NO_SHARING),
        "speedup_sim_no_deduction": sr.sim_ratio(NO_DEDUCTION),
        "parrot_sim_s": sr.cold[PARROT].seconds,
        "baseline_sim_s": sr.cold[BASELINE].seconds,
        "files_sim": sr.files,
    }


def point_payload(p: Point) -> dict[str, Any]:
    """One number of files for the JSON payload: the job's shape, the first jobs, the timed settings."""
    return {
        "files": p.files,
        "calls": len(p.workflow.calls),
        "stages": stage_roles(p.workflow),
        "longest_request_tokens": p.longest,
        "first_jobs": {name: asdict(c) for name, c in p.cold.items()},
        "settings": [
            {
                "network_delay": delay,
                "speedup": {n: r.as_dict() for n, r in p.speedups(delay).items()},
                "clients": measure.as_dicts(samples),
            }
            for delay, samples in p.settings.items()
        ],
    }


# ----------------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> None:
    p = record.parser(
        __doc__,
        "2 and 4 files, 1 round, short outputs, 2 repeats; the simulator at 16 files (~1.5 min)",
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
    setup = compared(EngineConfig(num_kv_blocks=cfg.num_kv_blocks), cfg.latency_cap_tokens)
    points = []
    for files in cfg.files:
        log(f"starting four servers ({args.model}) for {files} files ...")
        with systems.serve(args.model, setup, seed=cfg.seed) as servers:  # fresh: clean KV peaks
            points.append(asyncio.run(measure_files(servers, cfg, files, delays)))
    from server.sim import load_profile, run

    sims = [run(simulate_files(cfg, files)) for files in cfg.sim.files]
    print_report(rec, cfg, args.model, points, sims)
    rec.finish(
        result_metrics(points, sims),
        config=cfg,
        model=args.model,
        systems={s.name: s.describe() for s in setup},
        outputs_identical=True,
        by_files=[point_payload(p) for p in points],
        simulator={
            "profile": asdict(load_profile(cfg.sim.profile)),
            "systems": {s.name: s.describe() for s in compared(SIM_ENGINE, cfg.sim.latency_cap_tokens)},
            "by_files": [point_payload(s) for s in sims],
        },
        paper_anchor=PAPER_ANCHOR,
    )


# ----------------------------------------------------------------------------------------------- plot
def plot(payload: dict[str, Any], path: Path) -> None:
    """Fig. 18: latency vs files per system (the delay setting where measured), the exact KV peak vs files,
    and the simulated latency vs files."""
    plt = pyplot()
    rows = sorted(payload["by_files"], key=lambda r: r["files"])
    sim_rows = sorted(payload["simulator"]["by_files"], key=lambda r: r["files"])
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.2))
    files = [r["files"] for r in rows]
    delay = any(s["network_delay"] for r in rows for s in r["settings"])
    for name in CLIENTS:
        lat = [
            next(s for s in r["settings"] if s["network_delay"] == delay)["clients"][name]["latency"]
            for r in rows
        ]
        err = [[x["median"] - x["min"] for x in lat], [x["max"] - x["median"] for x in lat]]
        axes[0].errorbar(files, [x["median"] for x in lat], yerr=err, marker="o", capsize=3, label=name)
        axes[1].plot(files, [r["first_jobs"][name]["peak_blocks"] for r in rows], marker="o", label=name)
        sim_secs = [r["first_jobs"][name]["seconds"] for r in sim_rows]
        axes[2].plot([r["files"] for r in sim_rows], sim_secs, marker="o", label=name)
    title = "latency" + (" (network delay 0.2-0.3 s)" if delay else " (no network delay)")
    axes[0].set(xlabel="files", ylabel="end-to-end latency (s)", title=title, xticks=files)
    axes[1].set(xlabel="files", ylabel="peak KV blocks in use", title="KV memory (exact peak)", xticks=files)
    profile = payload["config"]["sim"]["profile"]
    axes[2].set(xlabel="files", ylabel="latency (simulated s)", title=f"simulator ({profile}, delay)")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.set_ylim(bottom=0)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"multi-agent programming ({payload.get('model', '')})")
    save(fig, path)


if __name__ == "__main__":
    main()
