"""Chat + map-reduce apps on a simulated 4-engine cluster: Parrot vs latency- and throughput-tuned baselines.

The paper's section 8.5 / Fig. 19 (four LLaMA-7B engines): latency-sensitive chat turns arrive at 1 req/s
while map-reduce summary apps (batch jobs) arrive in the background. The same seeded workload runs on each
system, each on a fresh simulated cluster (`server.sim`: the real manager, app and scheduler, steps timed
by the ``a100-llama7b`` profile, derived not measured; 64k-token KV cache per engine) on virtual time:

* **parrot** — chat as a ``criteria=P.LATENCY`` call, its reply fetched with the latency criteria; each
  app in its own session (map calls, then the reduce over their outputs), the summary fetched with
  ``criteria=P.THROUGHPUT``. Chat goes to the least-loaded engine under the latency cap (4096 tokens);
  an app's map calls form a task group placed together on the fullest engine running no latency work.
* **parrot, latency get** — the summary fetched with ``criteria=P.LATENCY`` (the job's end-to-end time
  is its objective, as in Fig. 14); shown for the trade-off, not in the RESULT line.
* **latency-tuned** — request-centric: ``POST /v1/completions`` per call (client-side map, then the
  reduce), least-loaded engine, each engine FIFO under 4096 running tokens (small, fast batches).
* **throughput-tuned** — the same with the FIFO cap at the KV capacity (65536 tokens: big batches).

Workload (deterministic from the seed): ShareGPT-like chat turns (`benchmarks.workloads.chat`: log-normal
prompt and reply lengths, greedy, EOS ignored) arriving as a Poisson process for ``window`` seconds;
``apps`` map-reduce apps arriving uniformly over the same window, each over 16-32 chunks of 1024 tokens
with 50-token maps and a 100-token reduce (the prompts of `benchmarks.map_reduce`). The default load keeps
the latency-tuned cluster near saturation, the paper's regime. No network delay.

Metrics, from arrival to answer: chat **normalized latency** (latency / output tokens) and map-reduce
**job completion time** (JCT). Ratios: baseline / Parrot of the means (medians over ``--seeds``). Paper
(Fig. 19): chat 5.5x vs latency-tuned and 1.23x vs throughput-tuned; JCT 3.7x and 1.05x.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, cast

from benchmarks.harness import rate_tables, record, sim_runs, systems
from benchmarks.harness.output import log, markdown_table
from benchmarks.harness.seed_runs import Result, SeedRun, ratio_cell, spread
from benchmarks.harness.stats import Spread, percentile
from benchmarks.plotting import pyplot, save
from benchmarks.workloads import mixed as workloads
from benchmarks.workloads.chat import SHAREGPT_LIKE, ChatLengths
from benchmarks.workloads.mixed import Workload
from server.engine import EngineConfig
from server.serve.manager import ManagerConfig
from server.sim import load_profile, run

NAME = "mixed"
PARROT, PARROT_LATENCY_GET = "parrot", "parrot, latency get"
LATENCY_TUNED, THROUGHPUT_TUNED = "latency-tuned", "throughput-tuned"
SYSTEMS = (PARROT, PARROT_LATENCY_GET, LATENCY_TUNED, THROUGHPUT_TUNED)
BASELINES = (LATENCY_TUNED, THROUGHPUT_TUNED)
CHAT, JCT = "chat_s_per_token_mean", "mapreduce_jct_s_mean"
HEADLINE = {  # RESULT key: the metric, the baseline over Parrot, and the paper's ratio (Fig. 19)
    "chat_latency_vs_throughput_tuned": (CHAT, THROUGHPUT_TUNED, 1.23),
    "mapreduce_jct_vs_latency_tuned": (JCT, LATENCY_TUNED, 3.7),
    "chat_latency_vs_latency_tuned": (CHAT, LATENCY_TUNED, 5.5),
    "mapreduce_jct_vs_throughput_tuned": (JCT, THROUGHPUT_TUNED, 1.05),
}


@dataclass(frozen=True)
class BenchConfig:
    window: float = 120.0  # virtual seconds during which requests arrive
    chat_rate: float = 1.0  # chat requests per second (Poisson)
    chat_lengths: ChatLengths = SHAREGPT_LIKE  # prompt and reply tokens, log-normal and clipped
    apps: int = 60  # map-reduce apps arriving during the window
    chunks: tuple[int, int] = (16, 32)  # document chunks per app (uniform)
    chunk_tokens: int = 1024
    map_tokens: int = 50
    reduce_tokens: int = 100
    engines: int = 4
    latency_cap_tokens: int = 4096  # the latency-tuned FIFO cap and Parrot's latency cap
    profile: str = "a100-llama7b"
    seed: int = 0
    seeds: int = 3  # workloads (seed, seed + 1, ...): medians over them


FULL = BenchConfig()
QUICK = BenchConfig(window=40.0, apps=20, seeds=1)
TINY = BenchConfig(window=4.0, apps=2, chunks=(2, 3), chunk_tokens=64, seeds=1)


def make_workload(cfg: BenchConfig, seed: int | None = None) -> Workload:
    """The workload of ``seed`` (default ``cfg.seed``) at ``cfg``'s sizes."""
    sizes = {k: getattr(cfg, k) for k in workloads.SIZES}
    return workloads.make_workload(cfg.seed if seed is None else seed, **sizes)


# ----------------------------------------------------------------------------------------------- runs
@dataclass
class SystemResult:
    """One system on one workload: latencies (virtual s, workload order) and the cluster's work."""

    chat_latency: list[float]
    chat_tokens: list[int]
    app_jct: list[float]
    work: sim_runs.Work

    def metrics(self) -> dict[str, float]:
        """Chat normalized latency (s/token) and map-reduce JCT (s): mean, median, p90, max."""
        norm = [lat / n for lat, n in zip(self.chat_latency, self.chat_tokens, strict=True)]
        out = {"chat_latency_s_mean": statistics.fmean(self.chat_latency) if norm else math.nan}
        for name, xs in (("chat_s_per_token", norm), ("mapreduce_jct_s", self.app_jct)):
            out[f"{name}_mean"] = statistics.fmean(xs) if xs else math.nan
            out |= {f"{name}_{q}": percentile(xs, p) for q, p in (("median", 50), ("p90", 90), ("max", 100))}
        return out

    def as_dict(self) -> dict[str, Any]:
        """The metrics, the cluster's work and every latency, for the JSON payload."""
        return {
            "metrics": self.metrics(),
            **asdict(self.work),
            "chat_latency_s": self.chat_latency,
            "chat_output_tokens": self.chat_tokens,
            "mapreduce_jct_s": self.app_jct,
        }


def system(name: str, cfg: BenchConfig, kv_tokens: int) -> systems.System:
    """Identical but for the engines' FIFO cap (the baselines') and Parrot's criteria at get."""
    cap = {LATENCY_TUNED: cfg.latency_cap_tokens, THROUGHPUT_TUNED: kv_tokens}.get(name)
    manager = ManagerConfig(latency_cap_tokens=cfg.latency_cap_tokens, openai_prefix_cache=False)
    return systems.System(name, EngineConfig(device="cpu", max_running_tokens=cap), manager, cfg.engines)


async def run_system(name: str, workload: Workload, cfg: BenchConfig) -> SystemResult:
    """The whole workload, open loop, on a fresh simulated cluster configured as system ``name``."""
    latency = load_profile(cfg.profile)
    criteria = "latency" if name == PARROT_LATENCY_GET else "throughput"
    async with sim_runs.simulated(system(name, cfg, latency.kv_tokens), latency) as served:
        baseline, model = name in BASELINES, served.model_name
        calls = workload.calls(served.http, baseline=baseline, model=model, criteria=criteria)
        times = cast(list[float], await sim_runs.open_loop(served, calls))  # a failure raises
        n = len(workload.chats)
        return SystemResult(times[:n], [c.max_tokens for c in workload.chats], times[n:], served.work())


def run_seed(workload: Workload, cfg: BenchConfig) -> SeedRun:
    """All systems on one workload, one after the other (each on its own virtual clock)."""
    log(f"seed {workload.seed}: {len(workload.chats)} chat turns, {len(workload.apps)} map-reduce apps")
    results: dict[str, Result] = {}
    for name in SYSTEMS:
        r = results[name] = run(run_system(name, workload, cfg))
        log(
            f"  seed {workload.seed} {name}: chat {r.metrics()[CHAT] * 1000:.1f} ms/token, map-reduce JCT "
            f"{r.metrics()[JCT]:.1f} s ({r.work.virtual_s:.0f} s virtual in {r.work.wall_s:.1f} s wall)"
        )
    return SeedRun(workload.summary(), results, HEADLINE, PARROT)


def results_table(runs: Sequence[SeedRun]) -> str:
    """Per system: chat normalized latency and map-reduce JCT (mean, p90; medians over seeds) and each
    baseline's ratio to Parrot (median over seeds, range)."""

    def ratio(metric: str, name: str) -> str:
        return ratio_cell(Spread.of(r.ratio(metric, name) for r in runs)) if name in BASELINES else ""

    def cells(name: str, prefix: str, scale: float) -> list[str]:
        """Mean and p90 (medians over seeds), and the ratio of the means to Parrot's."""
        mean, p90 = (spread(runs, f"{prefix}_{q}", name).median * scale for q in ("mean", "p90"))
        return [f"{mean:.1f}", f"{p90:.1f}", ratio(f"{prefix}_mean", name)]

    rows = [
        [name, *cells(name, "chat_s_per_token", 1000), *cells(name, "mapreduce_jct_s", 1)] for name in SYSTEMS
    ]
    headers = ["system", "chat ms/token mean", "p90", "chat: this / parrot", "map-reduce JCT s mean", "p90"]
    return markdown_table([*headers, "JCT: this / parrot"], rows, [False, *([True] * 6)])


def main(argv: list[str] | None = None) -> None:
    p = record.parser(
        __doc__,
        "40 s window, 20 apps, one seed (~30 s)",
        BenchConfig,
        engine=False,
        seed="first workload seed (default 0)",
        profile="the simulator's latency profile: a name under server/sim/profiles or a JSON file",
        seeds="workloads to run (default 3; quick 1)",
        window="virtual seconds during which requests arrive",
        apps="map-reduce apps arriving during the window",
        chat_rate="chat requests per second",
        chunk_tokens="tokens per document chunk",
        engines="simulated engines (default 4)",
    )
    p.add_argument("--chunks", type=int, nargs=2, metavar=("MIN", "MAX"), help="chunks per document")
    args = p.parse_args(argv)
    cfg = record.configured(args, FULL, QUICK, TINY)
    rec = record.Recorder(NAME, args)
    runs = [run_seed(make_workload(cfg, seed), cfg) for seed in range(cfg.seed, cfg.seed + cfg.seeds)]

    w, kv = runs[0].summary, load_profile(cfg.profile).kv_tokens
    print(rec.header(f"simulated cluster of {cfg.engines} engines ({cfg.profile} profile, virtual time)"))
    print(
        f"Workload of seed {w['seed']} over {cfg.window:g} virtual s: {w['chats']} chat turns (Poisson "
        f"{cfg.chat_rate:g} req/s), {w['apps']} map-reduce apps ({w['map_calls']} map calls over chunks of "
        f"{cfg.chunk_tokens} tokens). Latency cap {cfg.latency_cap_tokens} running tokens (latency-tuned "
        f"FIFO cap, Parrot's for latency-bound work); throughput-tuned FIFO cap {kv}. Medians over "
        f"{len(runs)} seed(s); ratios baseline / parrot of the means (range over seeds).\n"
    )
    print(results_table(runs) + "\n")
    works = {name: r.work for name, r in runs[0].systems.items()}
    print(f"Engine work, seed {w['seed']}:\n\n{rate_tables.engines_table(works)}\n")
    here = (f"{k} {v[2]:g}x (here {spread(runs, k).median:.2f}x)" for k, v in HEADLINE.items())
    print("paper anchors (Fig. 19, baseline / parrot): " + ", ".join(here))
    metrics = {k: spread(runs, k).median for k in HEADLINE}
    metrics["parrot_chat_s_per_token"] = spread(runs, CHAT).median
    metrics["parrot_mapreduce_jct_s"] = spread(runs, JCT).median
    rec.finish(
        metrics,
        config=cfg,
        profile=load_profile(cfg.profile),
        systems={name: system(name, cfg, kv).describe() for name in SYSTEMS},
        ratios={k: spread(runs, k).as_dict() for k in HEADLINE},
        ratios_latency_get={k: spread(runs, k, PARROT_LATENCY_GET).as_dict() for k in HEADLINE},
        paper_anchors={k: v[2] for k, v in HEADLINE.items()},
        seeds=[r.as_dict() for r in runs],
    )


def plot(payload: dict[str, Any], path: Path) -> None:
    """Fig. 19 (first seed): chat normalized latency and map-reduce job completion time per system."""
    plt = pyplot()
    results = payload["seeds"][0]["systems"]
    names = list(results)
    fig, (chat, jct) = plt.subplots(1, 2, figsize=(9, 3.4))
    chat.bar(names, [1000 * results[n]["metrics"][CHAT] for n in names])
    chat.set_ylabel("chat latency per output token (ms)")
    jct.bar(names, [results[n]["metrics"][JCT] for n in names], color="tab:orange")
    jct.set_ylabel("map-reduce JCT, mean (simulated s)")
    for ax in (chat, jct):
        ax.tick_params(axis="x", labelrotation=20, labelsize=8)
    save(fig, path)


if __name__ == "__main__":
    main()
