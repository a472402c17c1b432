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

import functools
import math
import statistics
from collections.abc import Awaitable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, cast

import httpx
import parrot as P

from benchmarks.common import Spread, log, markdown_table, percentile, safe_ratio
from benchmarks.harness import rates, record, systems
from benchmarks.harness.clients import complete, greedy
from benchmarks.map_reduce import MapReduceDoc, baseline_map_reduce, parrot_map_reduce
from benchmarks.plotting import pyplot, save
from benchmarks.workloads import mixed as workloads
from benchmarks.workloads.chat import SHAREGPT_LIKE, ChatLengths
from benchmarks.workloads.mixed import CHAT_TEMPLATE, ChatRequest, Workload
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
WORKLOAD = (
    "window",
    "chat_rate",
    "apps",
    "chunks",
    "chunk_tokens",
    "map_tokens",
    "reduce_tokens",
    "chat_lengths",
)


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
    sizes = {k: getattr(cfg, k) for k in WORKLOAD}
    return workloads.make_workload(cfg.seed if seed is None else seed, **sizes)


async def parrot_chat(client: httpx.AsyncClient, req: ChatRequest) -> str:
    """One chat turn through the `parrot` frontend: a latency-critical call, its reply fetched."""
    sampling = P.SamplingConfig(**greedy(req.max_tokens))
    chat = P.SemanticFunction.from_template(CHAT_TEMPLATE, name="chat", sampling=sampling, criteria=P.LATENCY)
    async with P.Session(str(client.base_url), client=client, timeout=3600.0):
        reply = chat(message=req.message)
        assert isinstance(reply, P.Variable)
        return str(await reply.aget(criteria=P.LATENCY))


# ----------------------------------------------------------------------------------------------- runs
@dataclass
class SystemResult:
    """One system on one workload: latencies (virtual s, workload order) and the cluster's work."""

    chat_latency: list[float]
    chat_tokens: list[int]
    app_jct: list[float]
    work: rates.Work

    def metrics(self) -> dict[str, float]:
        """Chat normalized latency (s/token) and map-reduce JCT (s): mean, median, p90, max."""
        norm = [lat / n for lat, n in zip(self.chat_latency, self.chat_tokens, strict=True)]
        out = {"chat_latency_s_mean": statistics.fmean(self.chat_latency) if norm else math.nan}
        for name, xs in (("chat_s_per_token", norm), ("mapreduce_jct_s", self.app_jct)):
            out[f"{name}_mean"] = statistics.fmean(xs) if xs else math.nan
            out |= {f"{name}_{q}": percentile(xs, p) for q, p in (("median", 50), ("p90", 90), ("max", 100))}
        return out


def system(name: str, cfg: BenchConfig, kv_tokens: int) -> systems.System:
    """Identical but for the engines' FIFO cap (the baselines') and Parrot's criteria at get."""
    cap = {LATENCY_TUNED: cfg.latency_cap_tokens, THROUGHPUT_TUNED: kv_tokens}.get(name)
    manager = ManagerConfig(latency_cap_tokens=cfg.latency_cap_tokens, openai_prefix_cache=False)
    return systems.System(name, EngineConfig(device="cpu", max_running_tokens=cap), manager, cfg.engines)


async def run_system(name: str, workload: Workload, cfg: BenchConfig) -> SystemResult:
    """The whole workload, open loop, on a fresh simulated cluster configured as system ``name``."""
    latency = load_profile(cfg.profile)
    baseline, criteria = name in BASELINES, "latency" if name == PARROT_LATENCY_GET else "throughput"
    async with rates.simulated(system(name, cfg, latency.kv_tokens), latency) as served:
        http, model = served.http, served.model_name

        def chat(c: ChatRequest) -> Awaitable[str]:
            return complete(http, c.prompt, c.max_tokens, model=model) if baseline else parrot_chat(http, c)

        def app(doc: MapReduceDoc) -> Awaitable[str]:
            if baseline:
                return baseline_map_reduce(http, doc, model=model)
            return parrot_map_reduce(http, doc, criteria=criteria, timeout=3600.0)

        calls = [(c.arrival, functools.partial(chat, c)) for c in workload.chats]
        calls += [(at, functools.partial(app, doc)) for at, doc in workload.apps]
        times = cast(list[float], await rates.open_loop(served, calls))  # a failure raises
        n = len(workload.chats)
        return SystemResult(times[:n], [c.max_tokens for c in workload.chats], times[n:], served.work())


@dataclass
class SeedRun:
    """Every system on the workload of one seed."""

    workload: Workload
    systems: dict[str, SystemResult]

    def ratio(self, metric: str, baseline: str, parrot: str = PARROT) -> float:
        """Baseline / Parrot of one metric (above 1: Parrot better)."""
        return safe_ratio(self.systems[baseline].metrics()[metric], self.systems[parrot].metrics()[metric])

    def ratios(self, parrot: str = PARROT) -> dict[str, float]:
        """The four headline ratios, keyed as `HEADLINE`."""
        return {key: self.ratio(metric, baseline, parrot) for key, (metric, baseline, _) in HEADLINE.items()}

    def as_dict(self) -> dict[str, Any]:
        systems_ = {
            name: {"metrics": r.metrics(), **asdict(r.work), "chat_latency_s": r.chat_latency}
            | {"chat_output_tokens": r.chat_tokens, "mapreduce_jct_s": r.app_jct}
            for name, r in self.systems.items()
        }
        return {"workload": self.workload.summary(), "ratios": self.ratios(), "systems": systems_}


def run_seed(workload: Workload, cfg: BenchConfig) -> SeedRun:
    """All systems on one workload, one after the other (each on its own virtual clock)."""
    results: dict[str, SystemResult] = {}
    for name in SYSTEMS:
        r = results[name] = run(run_system(name, workload, cfg))
        log(
            f"  seed {workload.seed} {name}: chat {r.metrics()[CHAT] * 1000:.1f} ms/token, map-reduce JCT "
            f"{r.metrics()[JCT]:.1f} s ({r.work.virtual_s:.0f} s virtual in {r.work.wall_s:.1f} s wall)"
        )
    return SeedRun(workload, results)


def spread(runs: Sequence[SeedRun], key: str, system: str = PARROT) -> Spread:
    """A headline ratio (key of `HEADLINE`, ``system`` as Parrot) or one system's metric, over seeds."""
    if key in HEADLINE:
        return Spread.of(r.ratios(system)[key] for r in runs)
    return Spread.of(r.systems[system].metrics()[key] for r in runs)


def results_table(runs: Sequence[SeedRun]) -> str:
    """Per system: chat normalized latency and map-reduce JCT (mean, p90; medians over seeds) and each
    baseline's ratio to Parrot (median over seeds, range)."""

    def ratio(metric: str, name: str) -> str:
        s = Spread.of(r.ratio(metric, name) for r in runs)
        return (
            f"{s.median:.2f}x" + (f" ({s.lo:.2f}-{s.hi:.2f})" if s.n > 1 else "") if name in BASELINES else ""
        )

    def cells(name: str, prefix: str, scale: float) -> list[str]:
        mean, p90 = (spread(runs, f"{prefix}_{q}", name).median * scale for q in ("mean", "p90"))
        return [f"{mean:.1f}", f"{p90:.1f}"]

    rows = [
        [name, *cells(name, "chat_s_per_token", 1000), ratio(CHAT, name), *cells(name, "mapreduce_jct_s", 1)]
        for name in SYSTEMS
    ]
    rows = [[*row, ratio(JCT, row[0])] for row in rows]
    headers = ["system", "chat ms/token mean", "p90", "chat: this / parrot", "map-reduce JCT s mean", "p90"]
    return markdown_table([*headers, "JCT: this / parrot"], rows, [False, *([True] * 6)])


def main(argv: list[str] | None = None) -> None:
    p = record.parser(
        __doc__,
        "40 s window, 20 apps, one seed (~30 s)",
        BenchConfig,
        engine=False,
        seed="first workload seed (default 0)",
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
    runs = []
    for seed in range(cfg.seed, cfg.seed + cfg.seeds):
        w = make_workload(cfg, seed)
        log(f"seed {seed}: {len(w.chats)} chat turns, {len(w.apps)} map-reduce apps")
        runs.append(run_seed(w, cfg))

    w, kv = runs[0].workload.summary(), load_profile(cfg.profile).kv_tokens
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
    print(f"Engine work, seed {w['seed']}:\n\n{rates.engines_table(works)}\n")
    here = (f"{k} {v[2]:g}x (here {spread(runs, k).median:.2f}x)" for k, v in HEADLINE.items())
    print("paper anchors (Fig. 19, baseline / parrot): " + ", ".join(here))
    rec.finish(
        {k: spread(runs, k).median for k in HEADLINE}
        | {
            "parrot_chat_s_per_token": spread(runs, CHAT).median,
            "parrot_mapreduce_jct_s": spread(runs, JCT).median,
        },
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
