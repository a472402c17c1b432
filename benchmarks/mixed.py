"""Mixed workload on a simulated 4-engine cluster: chat + map-reduce apps, Parrot vs two tuned baselines.

The experiment of section 8.5 / Fig. 19 of the Parrot paper (four LLaMA-7B engines): chat requests arrive
at 1 req/s while map-reduce summary apps arrive in the background. Chat is latency-sensitive (a user waits
for the reply); a map-reduce app is a batch job (throughput). The same seeded workload runs on each system,
each time on a fresh `server.sim.sim_cluster` — the real manager, HTTP app and engine scheduler over four
`SimEngine`s whose step time comes from a GPU latency profile (``a100-llama7b``: LLaMA-7B fp16 on one A100,
64k-token KV cache per engine; derived from datasheet figures, not measured) — on virtual time:

* **parrot** — chat through a semantic function submitted with ``criteria=P.LATENCY`` (one call per
  session, the reply fetched with ``aget(criteria=P.LATENCY)``); each map-reduce app in its own session:
  the map calls and the reduce call (its inputs are the map outputs) queued, then the summary fetched with
  ``aget(criteria=P.THROUGHPUT)`` — what a user declares for a batch job, and how the paper treats the
  map-reduce apps of this experiment. The server deduces the objectives: chat is latency-bound (it goes to
  the least-loaded engine whose running tokens stay under ``ManagerConfig.latency_cap_tokens``, 4096, and
  holds that engine to the cap while it runs); the map calls of an app form a task group, placed together
  on the fullest engine that runs no latency work, up to the engine's whole KV capacity; the reduce is
  throughput work placed the same way. Engines have no FIFO cap of their own.
* **parrot, latency get** — the same, but the map-reduce user fetches the summary with
  ``criteria=P.LATENCY`` (the job's end-to-end time is the objective, as in Fig. 14): the map group is
  placed on the least-loaded engine (still at full capacity) and the reduce is latency-bound. Shown for the
  trade-off; the ratios of the ``RESULT`` line are those of **parrot**.
* **latency-tuned** baseline — the request-centric service tuned for latency: every call is a plain
  ``POST /v1/completions`` (client-side map, then the reduce once all map answers are back; chat one
  request), the manager sends each request to the least-loaded engine, and every engine admits requests
  FIFO under a running-token cap of 4096 (`EngineConfig.max_running_tokens`: prompt + ``max_tokens`` of
  what runs) — small batches and fast decode steps, as long as nothing queues.
* **throughput-tuned** baseline — the same with the FIFO cap at the engine's KV capacity (65536 tokens):
  big batches, high throughput, and every request shares its steps with whatever else runs.

Workload (deterministic from the seed): chat requests arrive as a Poisson process (``chat_rate`` req/s)
during a window of ``window_s`` virtual seconds, ShareGPT-like: prompt and output lengths log-normal (prompt
median 300 tokens, sigma 0.6, clipped to 100-800; output median 140, sigma 0.5, clipped to 50-300), greedy
with EOS ignored, so every reply has exactly its drawn length. ``apps`` map-reduce apps arrive at times drawn
uniformly over the same window (a Poisson process conditioned on its count); each summarizes its own
document of 16-32 chunks (uniform) of 1024 tokens, with 50-token map outputs and a 100-token reduce (the
prompts of `benchmarks.map_reduce`). The default load (0.5 apps/s, ~12 map calls/s) keeps the
latency-tuned cluster ~90% busy, near saturation — the regime of the paper, where small batches cannot
keep up. All text is slices of the standard-library docstrings (`benchmarks.common.stdlib_text`) at random
offsets, counted with the embedded tokenizer (`server.sim.tiny_tokenizer`). The chat template's constant
text is shorter than ``min_shared_prefix_tokens``: the comparison is about scheduling, not prefix sharing.
No client network delay (in-process client), so the baseline's client round trip between the map and the
reduce stage costs it nothing here.

Every request that arrives in the window runs to completion and is timed from its arrival to the answer in
the client's hands: chat **normalized latency** (latency / output tokens, s/token — the paper's metric), mean
and p90 over the chat turns; map-reduce **job completion time** (JCT), mean and p90 over the apps. Ratios are
baseline / Parrot of the means, from the same workload on the same engine code and profile: above 1,
Parrot is better. With ``--seeds N`` the whole comparison is repeated on N workloads (seeds ``seed``...);
the figures are the medians over seeds and the ranges their spread. The simulation is deterministic: one
seed gives the same figures on every run. The paper's anchors (Fig. 19, baseline / Parrot): chat normalized
latency **5.5x** vs the latency-focused baseline (chat queues behind map requests under its small cap) and
1.23x vs the throughput-focused one; map-reduce JCT **3.7x** vs the latency-focused baseline and 1.05x vs
the throughput-focused one. Per system, the report also shows the engines' work (steps, busy time, prefill
and decode tokens) and where Parrot's scheduler placed the steps and why.

    python -m benchmarks.mixed [--quick] [--json PATH] [--seed N] [--seeds N] [--window S] [--apps M] ...
    (or python benchmarks/mixed.py ...)

The last line is ``RESULT mixed chat_latency_vs_throughput_tuned=... mapreduce_jct_vs_latency_tuned=...
chat_latency_vs_latency_tuned=... mapreduce_jct_vs_throughput_tuned=... parrot_chat_s_per_token=...
parrot_mapreduce_jct_s=... total_s=...`` (ratios of the means, baseline / Parrot; medians over seeds).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import statistics
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

if not __package__:
    # Run as a file, this script's directory would come first on sys.path (where `benchmarks/kernels.py`
    # shadows the `kernels` package); put the repository root there instead.
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import httpx
import parrot as P
from parrot.protocol import Criteria

from benchmarks.common import (
    Spread,
    add_size_flags,
    fmt_num,
    log,
    machine_info,
    markdown_table,
    percentile,
    render_template,
    result_line,
    safe_ratio,
    sized,
    write_json,
)
from benchmarks.map_reduce import MapReduceDoc, baseline_map_reduce, parrot_map_reduce
from benchmarks.plotting import pyplot, save
from benchmarks.workloads.chat import SHAREGPT_LIKE, ChatLengths, TextPool
from server.engine import EngineConfig
from server.serve.manager import ManagerConfig
from server.sim import SimCluster, load_profile, sim_cluster, tiny_tokenizer
from server.sim import run as sim_run

NAME = "mixed"
PARROT = "parrot"
PARROT_LATENCY_GET = "parrot, latency get"
LATENCY_TUNED = "latency-tuned"
THROUGHPUT_TUNED = "throughput-tuned"
SYSTEMS = (PARROT, PARROT_LATENCY_GET, LATENCY_TUNED, THROUGHPUT_TUNED)
BASELINES = (LATENCY_TUNED, THROUGHPUT_TUNED)
MODEL = "sim"  # the simulated engines' model name

# Fig. 19 of the paper, baseline / Parrot: chat normalized latency and map-reduce JCT against each baseline.
PAPER_ANCHORS = {
    "chat_latency_vs_throughput_tuned": 1.23,
    "mapreduce_jct_vs_latency_tuned": 3.7,
    "chat_latency_vs_latency_tuned": 5.5,
    "mapreduce_jct_vs_throughput_tuned": 1.05,
}

# The constant text is under the manager's `min_shared_prefix_tokens` (16): no prefix sharing across chats.
CHAT_TEMPLATE = """User: {{input:message}}
Assistant: {{output:reply}}"""


# ----------------------------------------------------------------------------------------------- config
@dataclass(frozen=True)
class BenchConfig:
    """What one run measures (see the module docstring)."""

    window_s: float = 120.0  # virtual seconds during which requests arrive
    chat_rate: float = 1.0  # chat requests per second (Poisson)
    chat_lengths: ChatLengths = SHAREGPT_LIKE  # prompt and reply tokens, log-normal and clipped
    apps: int = 60  # map-reduce apps arriving during the window
    chunks_min: int = 16  # document chunks per app (uniform)
    chunks_max: int = 32
    chunk_tokens: int = 1024
    map_tokens: int = 50
    reduce_tokens: int = 100
    engines: int = 4
    latency_cap_tokens: int = 4096  # the latency-tuned FIFO cap and Parrot's latency cap
    profile: str = "a100-llama7b"
    seed: int = 0
    seeds: int = 3  # workloads (seed, seed + 1, ...): medians over them


FULL = BenchConfig()
QUICK = BenchConfig(window_s=40.0, apps=20, seeds=1)
TINY = BenchConfig(window_s=4.0, apps=2, chunks_min=2, chunks_max=3, chunk_tokens=64, seeds=1)


# ----------------------------------------------------------------------------------------------- workload
@dataclass(frozen=True)
class ChatRequest:
    """One chat turn: arrival (virtual s after the start), the user's message and the reply's length."""

    index: int
    arrival: float
    message: str
    prompt_tokens: int
    max_tokens: int

    @property
    def prompt(self) -> str:
        """The rendered prompt (what the baseline sends; Parrot's server renders the same)."""
        return render_template(CHAT_TEMPLATE, {"message": self.message})


@dataclass(frozen=True)
class MapReduceApp:
    """One map-reduce job: arrival and its document (`benchmarks.map_reduce.MapReduceDoc`)."""

    index: int
    arrival: float
    doc: MapReduceDoc


@dataclass(frozen=True)
class Workload:
    """Everything that arrives during one run."""

    seed: int
    chats: tuple[ChatRequest, ...]
    apps: tuple[MapReduceApp, ...]

    def summary(self) -> dict[str, Any]:
        """Sizes of what is offered, for the report."""
        chunks = [len(a.doc.chunks) for a in self.apps]
        return {
            "seed": self.seed,
            "chats": len(self.chats),
            "chat_prompt_tokens": _describe([c.prompt_tokens for c in self.chats]),
            "chat_output_tokens": _describe([c.max_tokens for c in self.chats]),
            "apps": len(self.apps),
            "chunks_per_app": _describe(chunks),
            "map_calls": sum(chunks),
        }


def _describe(xs: Sequence[float]) -> dict[str, float]:
    if not xs:
        return {"mean": math.nan, "min": math.nan, "max": math.nan}
    return {"mean": statistics.fmean(xs), "min": min(xs), "max": max(xs)}


def make_workload(cfg: BenchConfig, seed: int | None = None) -> Workload:
    """The workload of ``seed`` (default ``cfg.seed``): chat turns (Poisson arrivals) and map-reduce apps
    (uniform arrivals), with text from random offsets of the stdlib docstrings."""
    seed = cfg.seed if seed is None else seed
    rng = random.Random(seed)
    tokenizer = tiny_tokenizer()
    pool = TextPool(tokenizer)
    chats: list[ChatRequest] = []
    t = rng.expovariate(cfg.chat_rate)
    while t < cfg.window_s:
        want, out = cfg.chat_lengths.sample(rng)
        message = pool.text(rng, want)
        prompt = render_template(CHAT_TEMPLATE, {"message": message})
        chats.append(ChatRequest(len(chats), t, message, len(tokenizer.encode(prompt)), out))
        t += rng.expovariate(cfg.chat_rate)
    arrivals = sorted(rng.uniform(0.0, cfg.window_s) for _ in range(cfg.apps))
    apps = []
    for i, at in enumerate(arrivals):
        n = rng.randint(cfg.chunks_min, cfg.chunks_max)
        chunks = tuple(pool.text(rng, cfg.chunk_tokens) for _ in range(n))
        doc = MapReduceDoc(chunks, cfg.map_tokens, cfg.reduce_tokens)
        apps.append(MapReduceApp(i, at, doc))
    return Workload(seed, tuple(chats), tuple(apps))


# ----------------------------------------------------------------------------------------------- clients
def _sampling(max_tokens: int) -> P.SamplingConfig:
    return P.SamplingConfig(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


async def parrot_chat(client: httpx.AsyncClient, req: ChatRequest) -> str:
    """One chat turn through the `parrot` frontend: a latency-critical call, its reply fetched."""
    chat = P.SemanticFunction.from_template(
        CHAT_TEMPLATE, name="chat", sampling=_sampling(req.max_tokens), criteria=P.LATENCY
    )
    async with P.Session(str(client.base_url), client=client, timeout=3600.0):
        reply = chat(message=req.message)
        assert isinstance(reply, P.Variable)
        return str(await reply.aget(criteria=P.LATENCY))


async def _complete(client: httpx.AsyncClient, prompt: str, max_tokens: int) -> str:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    response = await client.post("/v1/completions", json=body)
    response.raise_for_status()
    return str(response.json()["choices"][0]["text"])


async def baseline_chat(client: httpx.AsyncClient, req: ChatRequest) -> str:
    """One chat turn as one ``/v1/completions`` request."""
    return await _complete(client, req.prompt, req.max_tokens)


# ----------------------------------------------------------------------------------------------- running
@dataclass
class SystemResult:
    """One system on one workload: per-request latencies (virtual s), the engines' work, placements."""

    name: str
    chat_latency: list[float] = field(default_factory=list)  # in workload order
    chat_tokens: list[int] = field(default_factory=list)
    app_jct: list[float] = field(default_factory=list)
    virtual_s: float = 0.0
    wall_s: float = 0.0
    engines: list[dict[str, float]] = field(default_factory=list)
    placements: dict[str, int] = field(default_factory=dict)  # "engine/branch" -> steps (Parrot)

    @property
    def chat_norm(self) -> list[float]:
        """Normalized latency of every chat turn: seconds per output token."""
        return [lat / n for lat, n in zip(self.chat_latency, self.chat_tokens, strict=True)]

    def metrics(self) -> dict[str, float]:
        norm = self.chat_norm
        return {
            "chat_s_per_token_mean": _mean(norm),
            "chat_s_per_token_median": percentile(norm, 50),
            "chat_s_per_token_p90": percentile(norm, 90),
            "chat_latency_s_mean": _mean(self.chat_latency),
            "mapreduce_jct_s_mean": _mean(self.app_jct),
            "mapreduce_jct_s_median": percentile(self.app_jct, 50),
            "mapreduce_jct_s_p90": percentile(self.app_jct, 90),
            "mapreduce_jct_s_max": max(self.app_jct, default=math.nan),
        }


def _mean(xs: Sequence[float]) -> float:
    return statistics.fmean(xs) if xs else math.nan


def system_configs(name: str, cfg: BenchConfig, kv_tokens: int) -> tuple[EngineConfig, ManagerConfig]:
    """The engines' and the manager's configuration of one system (everything else is identical)."""
    caps = {LATENCY_TUNED: cfg.latency_cap_tokens, THROUGHPUT_TUNED: kv_tokens}
    engine = EngineConfig(device="cpu", max_running_tokens=caps.get(name))
    return engine, ManagerConfig(latency_cap_tokens=cfg.latency_cap_tokens, openai_prefix_cache=False)


def _engine_work(cluster: SimCluster) -> list[dict[str, float]]:
    work = []
    for engine in cluster.engines:
        st = engine.stats()
        work.append(
            {
                "steps": st.steps,
                "busy_s": engine.busy_seconds,
                "prefill_tokens": st.prefill_tokens_computed,
                "decode_tokens": st.decode_tokens_computed,
                "preemptions": st.preemptions,
                "evictions": st.evictions,
            }
        )
    return work


async def run_system(name: str, workload: Workload, cfg: BenchConfig) -> SystemResult:
    """The whole workload on a fresh simulated cluster configured as system ``name``."""
    latency = load_profile(cfg.profile)
    engine_config, manager_config = system_configs(name, cfg, latency.kv_tokens)
    criteria: Criteria = "latency" if name == PARROT_LATENCY_GET else "throughput"
    parrot = name in (PARROT, PARROT_LATENCY_GET)
    result = SystemResult(name)
    started = time.perf_counter()
    async with sim_cluster(
        cfg.engines, latency, engine_config=engine_config, manager_config=manager_config, model_name=MODEL
    ) as cluster:
        client = cluster.client
        t0 = cluster.now()

        async def timed(arrival: float, job: Callable[[], Awaitable[str]]) -> float:
            await asyncio.sleep(max(0.0, t0 + arrival - cluster.now()))
            start = cluster.now()
            await job()
            return cluster.now() - start

        def chat_job(req: ChatRequest) -> Callable[[], Awaitable[str]]:
            return lambda: parrot_chat(client, req) if parrot else baseline_chat(client, req)

        def app_job(doc: MapReduceDoc) -> Callable[[], Awaitable[str]]:
            return lambda: (
                parrot_map_reduce(client, doc, criteria=criteria, timeout=3600.0)
                if parrot
                else baseline_map_reduce(client, doc, model=MODEL)
            )

        chats = [timed(c.arrival, chat_job(c)) for c in workload.chats]
        apps = [timed(a.arrival, app_job(a.doc)) for a in workload.apps]
        times = await asyncio.gather(*chats, *apps)
        result.chat_latency = list(times[: len(chats)])
        result.chat_tokens = [c.max_tokens for c in workload.chats]
        result.app_jct = list(times[len(chats) :])
        result.virtual_s = cluster.now() - t0
        result.engines = _engine_work(cluster)
        placed: Counter[tuple[int, str]] = cluster.manager.placement.placed
        result.placements = {f"{e}/{r}": n for (e, r), n in sorted(placed.items())}
    result.wall_s = time.perf_counter() - started
    return result


@dataclass
class SeedRun:
    """Every system on the workload of one seed."""

    workload: Workload
    systems: dict[str, SystemResult]

    def ratio(self, metric: str, baseline: str, parrot: str = PARROT) -> float:
        """Baseline / Parrot of one metric (above 1: Parrot better)."""
        return safe_ratio(self.systems[baseline].metrics()[metric], self.systems[parrot].metrics()[metric])

    def ratios(self, parrot: str = PARROT) -> dict[str, float]:
        """The four headline ratios (means): chat normalized latency and map-reduce JCT, each baseline."""
        chat, jct = "chat_s_per_token_mean", "mapreduce_jct_s_mean"
        return {
            "chat_latency_vs_throughput_tuned": self.ratio(chat, THROUGHPUT_TUNED, parrot),
            "mapreduce_jct_vs_latency_tuned": self.ratio(jct, LATENCY_TUNED, parrot),
            "chat_latency_vs_latency_tuned": self.ratio(chat, LATENCY_TUNED, parrot),
            "mapreduce_jct_vs_throughput_tuned": self.ratio(jct, THROUGHPUT_TUNED, parrot),
        }


def run_seed(workload: Workload, cfg: BenchConfig) -> SeedRun:
    """All systems on one workload, one after the other (each on its own virtual clock)."""
    systems: dict[str, SystemResult] = {}
    for name in SYSTEMS:
        r = systems[name] = sim_run(run_system(name, workload, cfg))
        m = r.metrics()
        log(
            f"  seed {workload.seed} {name}: chat {m['chat_s_per_token_mean'] * 1000:.1f} ms/token, "
            f"map-reduce JCT {m['mapreduce_jct_s_mean']:.1f} s ({r.virtual_s:.0f} s virtual in "
            f"{r.wall_s:.1f} s wall)"
        )
    return SeedRun(workload, systems)


# ----------------------------------------------------------------------------------------------- report
def metric_spread(runs: Sequence[SeedRun], system: str, metric: str) -> Spread:
    """One system's metric over the seeds."""
    return Spread.of(r.systems[system].metrics()[metric] for r in runs)


def ratio_spread(runs: Sequence[SeedRun], key: str, parrot: str = PARROT) -> Spread:
    """One headline ratio over the seeds."""
    return Spread.of(r.ratios(parrot)[key] for r in runs)


def _x(s: Spread) -> str:
    if s.n <= 1:
        return f"{s.median:.2f}x"
    return f"{s.median:.2f}x ({s.lo:.2f}-{s.hi:.2f})"


def results_table(runs: Sequence[SeedRun]) -> str:
    """Per system: chat normalized latency (mean, p90) and map-reduce JCT (mean, p90), medians over seeds,
    and each baseline's ratio to Parrot (median over seeds, range)."""
    rows = []
    for name in SYSTEMS:

        def med(metric: str, scale: float = 1.0, digits: int = 1, name: str = name) -> str:
            return f"{metric_spread(runs, name, metric).median * scale:.{digits}f}"

        chat = jct = ""
        if name in BASELINES:
            chat = _x(Spread.of(r.ratio("chat_s_per_token_mean", name) for r in runs))
            jct = _x(Spread.of(r.ratio("mapreduce_jct_s_mean", name) for r in runs))
        rows.append(
            [
                name,
                med("chat_s_per_token_mean", 1000),
                med("chat_s_per_token_p90", 1000),
                med("chat_latency_s_mean", digits=2),
                chat,
                med("mapreduce_jct_s_mean"),
                med("mapreduce_jct_s_p90"),
                jct,
            ]
        )
    return markdown_table(
        [
            "system",
            "chat ms/token mean",
            "p90",
            "chat latency s",
            "chat: this / parrot",
            "map-reduce JCT s mean",
            "p90",
            "JCT: this / parrot",
        ],
        rows,
        [False, *([True] * 7)],
    )


def engines_table(run: SeedRun) -> str:
    """Per system and engine (one seed): steps, busy time, prefill and decode tokens, evictions."""
    rows = []
    for name in SYSTEMS:
        r = run.systems[name]
        for i, e in enumerate(r.engines):
            rows.append(
                [
                    name,
                    str(i),
                    fmt_num(e["steps"]),
                    f"{e['busy_s']:.1f} ({safe_ratio(e['busy_s'], r.virtual_s):.0%})",
                    fmt_num(e["prefill_tokens"]),
                    fmt_num(e["decode_tokens"]),
                    f"{e['preemptions']:.0f}/{e['evictions']:.0f}",
                ]
            )
    return markdown_table(
        [
            "system",
            "engine",
            "steps",
            "busy s (of the run)",
            "prefill tokens",
            "decode tokens",
            "preempt/evict",
        ],
        rows,
        [False, *([True] * 6)],
    )


def print_report(cfg: BenchConfig, runs: Sequence[SeedRun], machine: dict[str, Any], total: float) -> None:
    w = runs[0].workload.summary()
    kv = load_profile(cfg.profile).kv_tokens
    seeds = ", ".join(str(r.workload.seed) for r in runs)
    print(
        f"## mixed — simulated cluster of {cfg.engines} engines ({cfg.profile} profile, virtual time), "
        f"{machine['cpu_model']}, {machine['usable_cores']} cores\n"
    )
    cp, co, ch = w["chat_prompt_tokens"], w["chat_output_tokens"], w["chunks_per_app"]
    sentences = [
        f"Workload of seed {w['seed']}, arriving during {cfg.window_s:g} virtual s: {w['chats']} chat turns "
        f"(Poisson {cfg.chat_rate:g} req/s; prompts {cp['mean']:.0f} tokens mean, {cp['min']:.0f}-"
        f"{cp['max']:.0f}; replies {co['mean']:.0f} tokens mean, {co['min']:.0f}-{co['max']:.0f}) and "
        f"{w['apps']} map-reduce apps ({w['map_calls']} map calls: {ch['min']:.0f}-{ch['max']:.0f} chunks of "
        f"{cfg.chunk_tokens} tokens, {cfg.map_tokens}-token map outputs, {cfg.reduce_tokens}-token reduce).",
        "Latency from arrival to answer; chat normalized latency = latency / output tokens.",
        f"Latency cap {cfg.latency_cap_tokens} running tokens (the latency-tuned FIFO cap, and Parrot's for "
        f"latency-bound work); throughput-tuned FIFO cap {kv} (the KV cache).",
        f"Figures: medians over {len(runs)} seed(s) ({seeds}); ratios baseline / parrot of the means (range "
        "over seeds).",
    ]
    print(" ".join(sentences) + "\n")
    print(results_table(runs) + "\n")
    print(f"Engine work, seed {w['seed']}:\n")
    print(engines_table(runs[0]) + "\n")
    for name in (PARROT, PARROT_LATENCY_GET):
        placed = runs[0].systems[name].placements
        print(
            f"{name} placements, seed {w['seed']} (engine/branch: steps): "
            + ", ".join(f"{k} {v}" for k, v in placed.items())
        )
    walls = {n: sum(r.systems[n].wall_s for r in runs) for n in SYSTEMS}
    virtual = {n: sum(r.systems[n].virtual_s for r in runs) for n in SYSTEMS}
    print(
        "\nvirtual vs wall time (all seeds): "
        + ", ".join(f"{n} {virtual[n]:.0f} s virtual in {walls[n]:.1f} s wall" for n in SYSTEMS)
    )
    print(
        "paper anchors (Fig. 19, baseline / parrot): "
        + ", ".join(
            f"{k} {v:g}x (here {ratio_spread(runs, k).median:.2f}x)" for k, v in PAPER_ANCHORS.items()
        )
        + f". total {total:.0f} s"
    )


def json_payload(
    cfg: BenchConfig, runs: Sequence[SeedRun], machine: dict[str, Any], total: float
) -> dict[str, Any]:
    """Every figure, the raw per-request latencies per seed, and what is needed to reproduce them."""
    return {
        "benchmark": NAME,
        "config": asdict(cfg),
        "profile": asdict(load_profile(cfg.profile)),
        "machine": machine,
        "ratios": {k: ratio_spread(runs, k).as_dict() for k in PAPER_ANCHORS},
        "ratios_latency_get": {k: ratio_spread(runs, k, PARROT_LATENCY_GET).as_dict() for k in PAPER_ANCHORS},
        "paper_anchors": PAPER_ANCHORS,
        "seeds": [
            {
                "workload": run.workload.summary(),
                "ratios": run.ratios(),
                "systems": {
                    name: {
                        "metrics": r.metrics(),
                        "virtual_s": r.virtual_s,
                        "wall_s": r.wall_s,
                        "engines": r.engines,
                        "placements": r.placements,
                        "chat_latency_s": r.chat_latency,
                        "chat_output_tokens": r.chat_tokens,
                        "mapreduce_jct_s": r.app_jct,
                    }
                    for name, r in run.systems.items()
                },
            }
            for run in runs
        ],
        "total_s": total,
    }


def result_metrics(runs: Sequence[SeedRun], total: float) -> dict[str, float | int]:
    """The RESULT line: the four ratios (medians over seeds), then Parrot's own figures."""
    return {
        **{k: ratio_spread(runs, k).median for k in PAPER_ANCHORS},
        "parrot_chat_s_per_token": metric_spread(runs, PARROT, "chat_s_per_token_mean").median,
        "parrot_mapreduce_jct_s": metric_spread(runs, PARROT, "mapreduce_jct_s_mean").median,
        "total_s": total,
    }


# ----------------------------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_size_flags(parser, "40 s window, 20 apps, one seed (~30 s)")
    parser.add_argument("--seed", type=int, help="first workload seed (default 0)")
    parser.add_argument("--seeds", type=int, help="workloads to run (default 3; quick 1)")
    parser.add_argument("--window", type=float, help="virtual seconds during which requests arrive")
    parser.add_argument("--apps", type=int, help="map-reduce apps arriving during the window")
    parser.add_argument("--chat-rate", type=float, help="chat requests per second")
    parser.add_argument("--chunks", type=int, nargs=2, metavar=("MIN", "MAX"), help="chunks per document")
    parser.add_argument("--chunk-tokens", type=int, help="tokens per document chunk")
    parser.add_argument("--engines", type=int, help="simulated engines (default 4)")
    return parser.parse_args(argv)


def build_config(args: argparse.Namespace) -> BenchConfig:
    overrides: dict[str, Any] = {
        "seed": args.seed,
        "seeds": args.seeds,
        "window_s": args.window,
        "apps": args.apps,
        "chat_rate": args.chat_rate,
        "chunk_tokens": args.chunk_tokens,
        "engines": args.engines,
    }
    if args.chunks is not None:
        overrides["chunks_min"], overrides["chunks_max"] = args.chunks
    return sized(args, FULL, QUICK, TINY, **overrides)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    cfg = build_config(args)
    started = time.perf_counter()
    machine = machine_info()
    runs = []
    for seed in range(cfg.seed, cfg.seed + cfg.seeds):
        workload = make_workload(cfg, seed)
        w = workload.summary()
        log(f"seed {seed}: {w['chats']} chat turns, {w['apps']} map-reduce apps ({w['map_calls']} map calls)")
        runs.append(run_seed(workload, cfg))
    total = time.perf_counter() - started
    print_report(cfg, runs, machine, total)
    if args.json:
        write_json(args.json, json_payload(cfg, runs, machine, total))
    print(result_line(NAME, result_metrics(runs, total)))


def plot(payload: dict[str, Any], path: Path) -> None:
    """Fig. 19 from a results payload (first seed): chat normalized latency and map-reduce job completion
    time for every system."""
    plt = pyplot()
    systems = payload["seeds"][0]["systems"]
    names = list(systems)
    fig, (chat, jct) = plt.subplots(1, 2, figsize=(9, 3.4))
    chat.bar(names, [1000 * systems[n]["metrics"]["chat_s_per_token_mean"] for n in names])
    chat.set_ylabel("chat latency per output token (ms)")
    jct.bar(names, [systems[n]["metrics"]["mapreduce_jct_s_mean"] for n in names], color="tab:orange")
    jct.set_ylabel("map-reduce JCT, mean (simulated s)")
    for ax in (chat, jct):
        ax.tick_params(axis="x", labelrotation=20, labelsize=8)
    save(fig, path)


if __name__ == "__main__":
    main()
