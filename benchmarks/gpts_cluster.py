"""Serving GPTs-like apps on a simulated 4-engine cluster: the highest request rate each policy sustains.

The paper's Fig. 17 (section 8.3): four GPTs applications, each with a long system prompt shared by all
of its users, served by four LLaMA-7B engines; requests pick an app uniformly and arrive as a Poisson
process. Parrot sustains 12x the request rate of a baseline without sharing, 3x without its affinity
scheduling, and 2.4x that of Parrot without the shared-prefix kernel. Here the cluster is simulated
(`server.sim`): the real manager, HTTP app, scheduler and engine bookkeeping on virtual time, with each
engine step's time predicted by the ``a100-llama7b`` latency profile (a roofline derivation, not a
measurement: see its ``source``), so every figure below is simulated seconds of that model.

Workload (deterministic from ``--seed``): four apps with system prompts of about 1k, 3k, 5k and 7k tokens
(stdlib docstrings, counted with the simulator's tokenizer; each ends in a newline, so its tokens prefix
every prompt's whatever the query: a prompt ending in ``"User: "`` would merge that space into the
query's first token for most queries, giving each app two shared prefixes); each request picks an app
uniformly, asks a user query of 20-60 tokens and generates 64-128 tokens (EOS ignored, so exactly that
many). Arrivals are Poisson at rate R for ``--duration`` simulated seconds (15; quick: 5): the same
unit-rate gaps scaled by 1/R for every run, and request *i* is the same request in every run (common
random numbers across rates and policies). Requests arriving in the first ``warmup`` seconds (2; quick:
1) are served but not measured — a long-running service holds its apps' system prompts already, and an
empty cluster is not a steady state either. Every run waits until all its requests are done. No network
delay (the clients talk to the app in-process; every policy equally).

Runs last a fixed simulated time, not a fixed number of requests: with a fixed count, a fast policy at a
high rate receives its whole workload as one short burst, which it may absorb within the bound without
keeping up with the rate at all (in a 120-request trial, Parrot "sustained" 181 req/s while completing
17 per second). Over a fixed duration, a rate above what the cluster serves builds a queue that grows
through the run, and the latency shows it (the ``drain`` column: how long the run went on after the last
arrival). Quick runs are short, so their rates come out higher than the full runs'.

Policies, each on a fresh cluster of ``--engines`` engines (64k-token KV cache each, 16k context):

* **parrot** — the `parrot` frontend: each request is one semantic-function call in its own session,
  ``get(criteria=P.LATENCY)``. The system prompt (the template's leading constant text) becomes a shared
  engine context forked by every call of the app; the scheduler places calls on the engine holding their
  prefix (``prefix_affinity``), and decodes read the shared prefix once per step (shared-prefix kernel).
  Latency-critical calls keep an engine under the manager's latency cap (``latency_cap_tokens``, 4096
  tokens beyond shared prefixes, the default).
* **parrot_no_affinity** — the same with ``ManagerConfig(prefix_affinity=False)``: the scheduler sees no
  prefixes, so it places by load alone; an engine still forks a prefix it happens to hold (so each engine
  ends up holding every app's prompt and batches mix apps).
* **parrot_no_kernel** — affinity on, latency profile with ``shared_prefix_decode=False``: a shared prefix
  is stored once but its KV is read once per sequence at every decode step (vLLM's PagedAttention).
* **baseline** — request-centric, like vLLM behind a load balancer: the client renders the whole prompt
  and sends ``POST /v1/completions``; no prefix is shared; the manager picks the least loaded engine; the
  engine admits FIFO under a token cap of its whole KV cache (``--baseline-cap``, default 65536 tokens:
  what vLLM fills, reserved up front here so nothing is preempted).
* **baseline_capped** — the same, with the engines' FIFO cap at the latency cap (4096 tokens): the
  paper's latency-centric baseline setting (section 8.2, "a limited token capacity (4096 tokens)"), which
  runs a long-prompt request nearly alone. Reported beside the headline baseline, as the setting closest
  to the paper's; the headline ratio is against the stronger uncapped baseline.

Metric: normalized latency of a request = (completion - arrival) / output tokens, in seconds per token
(the paper's, after Orca and vLLM). A rate is *sustained* when the mean normalized latency of the
measured requests is within the bound (``--bound``, default 0.04 s/token: about 2.5x Parrot's unloaded 15
ms/token on this profile — the baseline's is ~25, as it prefills whole prompts — and the 40 ms per output
token the paper quotes at a batch of 32 in Fig. 16) and no request failed. The p50 and p90 are reported
too. For each policy the highest sustained rate is searched: a geometric grid (``--start-rate``, 4 req/s,
doubled until a rate fails, halved if that one fails already), then bisection in log space between the
last rate that passed and the first that failed (3 steps, quick: 1; ``--rate R`` measures one rate
instead, no search). Ratios of the highest sustained rates: parrot over each of the others (paper: 12x vs
baseline, 3x vs no affinity, 2.4x vs no kernel). The search's resolution is the last bracket (the "first
failed" column): a ratio is good to about that factor.

    python -m benchmarks.gpts_cluster [--quick] [--json PATH] [--duration S] [--bound S] [--rate R] ...
    (or python benchmarks/gpts_cluster.py ...)

The simulation tokenizes nothing twice: the engines' tokenizer is wrapped in a memo shared by all runs
(`MemoTokenizer`: the same ids; tokenizing takes no simulated time either way). The manager encodes every
prompt whole, and each app's system prompt again for every call; without the memo that would be most of
the benchmark's wall time.

The last line is ``RESULT gpts_cluster parrot_rate=... baseline_rate=... no_affinity_rate=...
no_kernel_rate=... capped_baseline_rate=... speedup_vs_baseline=... speedup_vs_no_affinity=...
speedup_vs_no_kernel=... speedup_vs_capped_baseline=... total_s=...`` (rates in requests per simulated
second; speedups: Parrot's rate over the other's; ``total_s`` the wall seconds of the whole benchmark).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import math
import random
import statistics
import sys
import time
from array import array
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

if not __package__:
    # Run as a file, this script's directory would come first on sys.path (where `benchmarks/kernels.py`
    # shadows the `kernels` package); put the repository root there instead.
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import parrot as P

from benchmarks.common import (
    add_size_flags,
    load_average,
    log,
    machine_info,
    markdown_table,
    percentile,
    render_template,
    result_line,
    safe_ratio,
    sized,
    stdlib_text,
    write_json,
)
from benchmarks.plotting import pyplot, save
from server.engine.config import EngineConfig
from server.serve.manager import ManagerConfig
from server.sim import LatencyModel, load_profile, run, sim_cluster, tiny_tokenizer

NAME = "gpts_cluster"

PARROT = "parrot"
NO_AFFINITY = "parrot_no_affinity"
NO_KERNEL = "parrot_no_kernel"
BASELINE = "baseline"
CAPPED = "baseline_capped"
POLICIES = (PARROT, NO_AFFINITY, NO_KERNEL, BASELINE, CAPPED)

# The paper's four GPTs categories (section 8.3); system prompt sizes from the issue.
APP_NAMES = ("productivity", "programming", "image_generation", "data_analysis")
PAPER_ANCHOR = {BASELINE: 12.0, NO_AFFINITY: 3.0, NO_KERNEL: 2.4, CAPPED: 12.0}


@dataclass(frozen=True)
class BenchConfig:
    """What one run of the benchmark measures."""

    engines: int = 4
    duration_s: float = 15.0  # simulated seconds of arrivals per run (one policy at one rate)
    warmup_s: float = 2.0  # requests arriving before this are served but not measured
    system_tokens: tuple[int, ...] = (1000, 3000, 5000, 7000)
    query_tokens: tuple[int, int] = (20, 60)
    output_tokens: tuple[int, int] = (64, 128)
    bound_s_per_token: float = 0.04  # the mean normalized latency a sustained rate stays within
    start_rate: float = 4.0  # requests per simulated second; the grid doubles (or halves) from here
    max_rate: float = 256.0
    min_rate: float = 0.25
    bisect_steps: int = 3
    fixed_rate: float | None = None  # measure this rate only (no search)
    baseline_cap: int | None = None  # engines' FIFO token cap (None: the whole KV cache)
    latency_cap: int | None = None  # the manager's latency_cap_tokens (None: its default)
    profile: str = "a100-llama7b"
    seed: int = 0


def app_sizes(apps: int) -> tuple[int, ...]:
    """System-prompt sizes of ``apps`` apps: the paper's four sizes, repeated."""
    if apps < 1:
        raise SystemExit("--apps must be at least 1")
    return tuple(BenchConfig.system_tokens[i % 4] for i in range(apps))


FULL = BenchConfig()
QUICK = BenchConfig(duration_s=5.0, warmup_s=1.0, bisect_steps=1)
TINY = BenchConfig(duration_s=2.5, warmup_s=0.0, fixed_rate=4.0)


# ----------------------------------------------------------------------------------------------- workload
@dataclass(frozen=True)
class App:
    """One GPTs-like app: its template (system prompt, then the user's query) and the prompt's size."""

    name: str
    template: str
    system_tokens: int  # tokens of the leading constant text (the shared prefix), BOS included


@dataclass(frozen=True)
class Job:
    """One user request: which app, the query, how many tokens it generates, and its unit-rate gap."""

    app: int
    query: str
    query_tokens: int
    max_tokens: int
    gap: float  # exponential(1): the inter-arrival time at rate R is gap / R


@dataclass(frozen=True)
class Workload:
    """The apps and a long deterministic stream of requests; a run takes the first ones that arrive in
    its duration."""

    apps: list[App]
    jobs: list[Job]

    def arrivals(self, rate: float, duration_s: float) -> list[tuple[Job, float]]:
        """The requests arriving within ``duration_s`` at ``rate`` req/s, with their arrival times."""
        out: list[tuple[Job, float]] = []
        t = 0.0
        for job in self.jobs:
            t += job.gap / rate
            if t > duration_s:
                return out
            out.append((job, t))
        raise ValueError(
            f"the workload holds {len(self.jobs)} requests, fewer than {duration_s:g} s at {rate:g} req/s "
            "needs: raise max_rate"
        )

    def prompt(self, job: Job) -> str:
        """The request's whole prompt as a request-centric client renders it."""
        return render_template(self.apps[job.app].template, {"query": job.query})


def jobs_needed(cfg: BenchConfig) -> int:
    """Enough requests for the highest rate a run may use (Poisson: a margin above rate x duration)."""
    rate = max(cfg.max_rate, cfg.fixed_rate or 0.0, cfg.start_rate)
    mean = rate * cfg.duration_s
    return int(mean + 6 * math.sqrt(mean) + 64)


def make_workload(cfg: BenchConfig) -> Workload:
    """Apps and requests, deterministic from ``cfg.seed`` (text: stdlib docstrings, never downloaded)."""
    tokenizer = tiny_tokenizer()
    rng = random.Random(cfg.seed)
    need = sum(cfg.system_tokens) + 20_000  # the system prompts, then a pool the queries are cut from
    chars = 4 * need
    while True:
        ids = tokenizer(stdlib_text(chars), add_special_tokens=False).input_ids
        if len(ids) >= need:
            break
        chars *= 2
    apps: list[App] = []
    offset = 0
    for i, n in enumerate(cfg.system_tokens):
        name = APP_NAMES[i % len(APP_NAMES)] + (f"_{i}" if i >= len(APP_NAMES) else "")
        body = tokenizer.decode(ids[offset : offset + n])
        offset += n
        system = (
            f"You are a GPT for {name.replace('_', ' ')}. Answer the user's request following the "
            f"instructions, rules and examples below.\n\n{body}\n\nUser:\n"
        )
        # The system prompt ends in a newline, which no query merges with: its tokens prefix every prompt's.
        template = system + "{{input:query}}\n\nAssistant:\n{{output:answer}}"
        apps.append(App(name, template, len(tokenizer.encode(system))))
    pool = ids[offset:]
    jobs: list[Job] = []
    for _ in range(jobs_needed(cfg)):
        app = rng.randrange(len(apps))
        n = rng.randint(*cfg.query_tokens)
        start = rng.randrange(len(pool) - n)
        query = tokenizer.decode(pool[start : start + n]).strip()
        max_tokens = rng.randint(*cfg.output_tokens)
        jobs.append(Job(app, query, n, max_tokens, rng.expovariate(1.0)))
    return Workload(apps, jobs)


# ----------------------------------------------------------------------------------------------- one run
@dataclass
class Point:
    """One policy at one rate: the measured requests' normalized latencies and what the cluster did."""

    policy: str
    rate: float
    norm_latency: list[float]  # seconds per output token, per measured request (arrival order)
    requests: int  # every request of the run, warm-up included
    last_arrival_s: float
    virtual_s: float  # simulated seconds from the start to the last completion
    wall_s: float
    engine_stats: list[dict[str, Any]] = field(default_factory=list)
    placed: dict[str, int] = field(default_factory=dict)  # "engine/branch" -> steps (Parrot only)
    failures: int = 0

    @property
    def mean(self) -> float:
        return statistics.fmean(self.norm_latency) if self.norm_latency else math.nan

    @property
    def p50(self) -> float:
        return percentile(self.norm_latency, 50)

    @property
    def p90(self) -> float:
        return percentile(self.norm_latency, 90)

    @property
    def drain_s(self) -> float:
        """How long the run went on after the last arrival: a queue that grew through the run shows here."""
        return self.virtual_s - self.last_arrival_s

    def sustained(self, bound: float) -> bool:
        return self.failures == 0 and bool(self.norm_latency) and self.mean <= bound

    def summary(self) -> dict[str, Any]:
        return {
            "rate": self.rate,
            "requests": self.requests,
            "measured": len(self.norm_latency),
            "mean_s_per_token": self.mean,
            "p50_s_per_token": self.p50,
            "p90_s_per_token": self.p90,
            "drain_s": self.drain_s,
            "virtual_s": self.virtual_s,
            "wall_s": self.wall_s,
            "failures": self.failures,
            "engine_stats": self.engine_stats,
            "placed": self.placed,
        }


class MemoTokenizer:
    """A tokenizer whose ``encode`` remembers its answers (the same ids; all else passes through).

    Tokenizing takes no simulated time, but wall time it does: the manager encodes every prompt whole and
    an app's system prompt again for each call. Request *i* is the same prompt in every run, so one memo
    shared by all runs (`memo_tokenizer`) encodes each text once per benchmark. Ids are kept as int32
    arrays (a thousand 4k-token prompts: some 16 MB).
    """

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self._memo: dict[tuple[str, bool], array[int]] = {}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        key = (text, add_special_tokens)
        ids = self._memo.get(key)
        if ids is None:
            ids = self._memo[key] = array(
                "i", self._inner.encode(text, add_special_tokens=add_special_tokens)
            )
        return ids.tolist()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


_MEMOS: dict[int, MemoTokenizer] = {}


def memo_tokenizer(inner: Any) -> MemoTokenizer:
    """The one `MemoTokenizer` of ``inner`` in this process."""
    if id(inner) not in _MEMOS:
        _MEMOS[id(inner)] = MemoTokenizer(inner)
    return _MEMOS[id(inner)]


def policy_setup(policy: str, cfg: BenchConfig) -> tuple[LatencyModel, EngineConfig, ManagerConfig]:
    """The latency profile, engine config and manager config of ``policy``.

    Every policy's engines but the capped baseline's admit FIFO under the same token cap (the baseline's;
    for Parrot it never binds: the manager keeps latency-critical work far under it), so the policies
    differ only where named.
    """
    profile = load_profile(cfg.profile)
    if policy == NO_KERNEL:
        profile = dataclasses.replace(profile, shared_prefix_decode=False)
    # The baselines' OpenAI route caches nothing (the paper's vLLM without sharing).
    manager_config = ManagerConfig(prefix_affinity=policy != NO_AFFINITY, openai_prefix_cache=False)
    if cfg.latency_cap is not None:
        manager_config.latency_cap_tokens = cfg.latency_cap
    cap = cfg.baseline_cap or profile.kv_tokens
    if policy == CAPPED:
        cap = manager_config.latency_cap_tokens
    return profile, EngineConfig(device="cpu", max_running_tokens=cap), manager_config


async def _simulate(policy: str, rate: float, workload: Workload, cfg: BenchConfig) -> Point:
    profile, engine_config, manager_config = policy_setup(policy, cfg)
    arrivals = workload.arrivals(rate, cfg.duration_s)
    functions: dict[tuple[int, int], P.SemanticFunction] = {}

    def function(job: Job) -> P.SemanticFunction:
        """The app's semantic function generating ``job.max_tokens`` tokens (one per app and length)."""
        key = (job.app, job.max_tokens)
        if key not in functions:
            app = workload.apps[job.app]
            functions[key] = P.SemanticFunction.from_template(
                app.template,
                name=app.name,
                sampling=P.SamplingConfig(max_tokens=job.max_tokens, ignore_eos=True),
            )
        return functions[key]

    async with sim_cluster(
        cfg.engines, profile, engine_config=engine_config, manager_config=manager_config
    ) as cluster:
        for engine in cluster.engines:
            engine.tokenizer = memo_tokenizer(engine.tokenizer)
        t0 = cluster.now()

        async def parrot_request(job: Job) -> None:
            """One call in its own session, fetched with the latency criteria."""
            async with P.Session(cluster.url, client=cluster.client) as s:
                out = function(job)(query=s.variable(job.query))
                await out.aget(criteria=P.LATENCY)

        async def baseline_request(job: Job) -> None:
            """The whole rendered prompt to the OpenAI-compatible endpoint."""
            body = {
                "model": "sim",
                "prompt": workload.prompt(job),
                "max_tokens": job.max_tokens,
                "ignore_eos": True,
                "temperature": 0,
            }
            r = await cluster.client.post("/v1/completions", json=body)
            r.raise_for_status()
            got = r.json()["usage"]["completion_tokens"]
            if got != job.max_tokens:
                raise RuntimeError(f"generated {got} tokens, not {job.max_tokens}")

        send: Callable[[Job], Awaitable[None]] = (
            baseline_request if policy in (BASELINE, CAPPED) else parrot_request
        )

        async def one(job: Job, at: float) -> float | None:
            await asyncio.sleep(max(0.0, t0 + at - cluster.now()))
            start = cluster.now()
            try:
                await send(job)
            except Exception as e:  # reported; the rate then counts as not sustained
                log(f"  {policy} @ {rate:g} req/s: a request failed: {e!r}")
                return None
            return (cluster.now() - start) / job.max_tokens

        wall = time.perf_counter()
        got = await asyncio.gather(*(one(job, at) for job, at in arrivals))
        wall = time.perf_counter() - wall
        virtual = cluster.now() - t0
        stats = [e.stats().model_dump() | {"busy_s": e.busy_seconds} for e in cluster.engines]
        placed = {f"{e}/{reason}": n for (e, reason), n in sorted(cluster.manager.placement.placed.items())}
    measured = [x for (_, at), x in zip(arrivals, got, strict=True) if at >= cfg.warmup_s and x is not None]
    return Point(
        policy,
        rate,
        measured,
        requests=len(arrivals),
        last_arrival_s=arrivals[-1][1] if arrivals else 0.0,
        virtual_s=virtual,
        wall_s=wall,
        engine_stats=stats,
        placed=placed,
        failures=sum(x is None for x in got),
    )


def run_point(policy: str, rate: float, workload: Workload, cfg: BenchConfig) -> Point:
    """Simulate ``policy`` at ``rate`` on a fresh cluster (a fresh virtual-time loop)."""
    point = run(_simulate(policy, rate, workload, cfg))
    log(
        f"  {policy:<18} {rate:8.2f} req/s: mean {point.mean * 1e3:6.1f} ms/token, p90 "
        f"{point.p90 * 1e3:6.1f}, drain {point.drain_s:5.1f} s: "
        f"{'ok' if point.sustained(cfg.bound_s_per_token) else 'over'} ({point.requests} requests, "
        f"{point.virtual_s:.1f} simulated s in {point.wall_s:.1f} wall s)"
    )
    return point


# ----------------------------------------------------------------------------------------------- search
@dataclass
class Search:
    """Every rate tried for one policy, and the highest that was sustained."""

    policy: str
    points: list[Point]
    best: float  # the highest sustained rate found (0: not even the lowest tried)
    first_failed: float  # the lowest rate found not sustained (inf: none)

    def point_at(self, rate: float) -> Point | None:
        return next((p for p in self.points if p.rate == rate), None)


def find_max_rate(
    policy: str,
    workload: Workload,
    cfg: BenchConfig,
    measure: Callable[[str, float, Workload, BenchConfig], Point] = run_point,
) -> Search:
    """The highest rate ``policy`` sustains: doubling from ``start_rate`` (halving if that fails already),
    then ``bisect_steps`` bisections in log space between the last pass and the first failure. With
    ``fixed_rate`` set, that one rate only."""
    points: list[Point] = []

    def ok(rate: float) -> bool:
        point = measure(policy, rate, workload, cfg)
        points.append(point)
        return point.sustained(cfg.bound_s_per_token)

    good, bad = 0.0, math.inf
    if cfg.fixed_rate is not None:
        if ok(cfg.fixed_rate):
            good = cfg.fixed_rate
        else:
            bad = cfg.fixed_rate
        return Search(policy, points, good, bad)
    rate = cfg.start_rate
    if ok(rate):
        good = rate
        while good * 2 <= cfg.max_rate:
            if not ok(good * 2):
                bad = good * 2
                break
            good *= 2
    else:
        bad = rate
        while bad / 2 >= cfg.min_rate:
            if ok(bad / 2):
                good = bad / 2
                break
            bad /= 2
    if good > 0 and math.isfinite(bad):
        for _ in range(cfg.bisect_steps):
            mid = math.sqrt(good * bad)
            if ok(mid):
                good = mid
            else:
                bad = mid
    return Search(policy, sorted(points, key=lambda p: p.rate), good, bad)


# ----------------------------------------------------------------------------------------------- report
def ratios(searches: dict[str, Search]) -> dict[str, float]:
    """Parrot's highest sustained rate over each other policy's."""
    best = searches[PARROT].best
    return {
        "speedup_vs_baseline": safe_ratio(best, searches[BASELINE].best),
        "speedup_vs_no_affinity": safe_ratio(best, searches[NO_AFFINITY].best),
        "speedup_vs_no_kernel": safe_ratio(best, searches[NO_KERNEL].best),
        "speedup_vs_capped_baseline": safe_ratio(best, searches[CAPPED].best),
    }


def rates_table(searches: dict[str, Search], cfg: BenchConfig) -> str:
    """Every rate tried, per policy: normalized latency (mean, p50, p90), drain time, sustained or not."""
    rows = []
    for policy, search in searches.items():
        for p in search.points:
            verdict = "yes" if p.sustained(cfg.bound_s_per_token) else "no"
            rows.append(
                [
                    policy,
                    f"{p.rate:.2f}",
                    f"{len(p.norm_latency)}/{p.requests}",
                    f"{p.mean * 1e3:.1f}",
                    f"{p.p50 * 1e3:.1f}",
                    f"{p.p90 * 1e3:.1f}",
                    f"{p.drain_s:.1f}",
                    f"{p.virtual_s:.1f}",
                    f"{p.wall_s:.1f}",
                    verdict + (f" ({p.failures} failed)" if p.failures else ""),
                ]
            )
    return markdown_table(
        [
            "policy",
            "rate req/s",
            "measured/all",
            "mean ms/token",
            "p50",
            "p90",
            "drain s",
            "simulated s",
            "wall s",
            "sustained",
        ],
        rows,
        [False, True, True, True, True, True, True, True, True, False],
    )


def summary_table(searches: dict[str, Search]) -> str:
    """The highest sustained rate per policy, its latency there, and Parrot's ratio over it."""
    parrot = searches[PARROT].best
    rows = []
    for policy, search in searches.items():
        p = search.point_at(search.best)
        anchor = PAPER_ANCHOR.get(policy)
        rows.append(
            [
                policy,
                f"{search.best:.2f}",
                f"{search.first_failed:.2f}",
                "n/a" if p is None else f"{p.mean * 1e3:.1f}",
                "n/a" if p is None else f"{p.p90 * 1e3:.1f}",
                "" if policy == PARROT else f"{safe_ratio(parrot, search.best):.2f}x",
                "" if anchor is None else f"{anchor:g}x",
            ]
        )
    return markdown_table(
        [
            "policy",
            "max sustained req/s",
            "first failed",
            "mean ms/token there",
            "p90",
            "parrot / this",
            "paper",
        ],
        rows,
        [False, True, True, True, True, True, True],
    )


def engines_table(searches: dict[str, Search]) -> str:
    """At each policy's highest sustained rate: prefill tokens computed, decode batch and step time per
    engine, and which scheduler branch placed Parrot's calls."""
    rows = []
    for policy, search in searches.items():
        p = search.point_at(search.best)
        if p is None:
            continue
        by_reason: Counter[str] = Counter()
        for key, n in p.placed.items():
            by_reason[key.split("/", 1)[1]] += n
        stats = p.engine_stats
        rows.append(
            [
                policy,
                f"{p.rate:.2f}",
                " ".join(f"{s['prefill_tokens_computed'] / 1000:.0f}k" for s in stats),
                " ".join(f"{safe_ratio(s['decode_tokens_computed'], s['steps']):.0f}" for s in stats),
                " ".join(f"{safe_ratio(s['busy_s'], s['steps']) * 1e3:.0f}" for s in stats),
                " ".join(f"{safe_ratio(s['busy_s'], p.virtual_s):.0%}" for s in stats),
                " ".join(f"{r}:{n}" for r, n in sorted(by_reason.items())) or "-",
            ]
        )
    return markdown_table(
        [
            "policy",
            "rate",
            "prefill tokens per engine",
            "decodes/step",
            "ms/step",
            "busy",
            "Parrot calls placed by",
        ],
        rows,
        [False, True, True, True, True, True, False],
    )


def print_report(
    cfg: BenchConfig, workload: Workload, machine: dict[str, Any], searches: dict[str, Search], total_s: float
) -> None:
    profile, engine_config, manager_config = policy_setup(BASELINE, cfg)
    points = [p for s in searches.values() for p in s.points]
    virtual = sum(p.virtual_s for p in points)
    wall = sum(p.wall_s for p in points)
    print(
        f"## gpts_cluster — simulated {cfg.engines} engines, latency profile {profile.name} "
        f"({profile.kv_tokens:,}-token KV cache each); run on {machine['cpu_model']}, "
        f"{machine['usable_cores']} cores, load average {machine['load_average_1m']} at start\n"
    )
    print(
        f"{len(workload.apps)} apps, system prompts of "
        + ", ".join(f"{a.system_tokens:,}" for a in workload.apps)
        + f" tokens; requests pick an app uniformly, queries of {cfg.query_tokens[0]}-{cfg.query_tokens[1]} "
        f"tokens, outputs of {cfg.output_tokens[0]}-{cfg.output_tokens[1]} tokens (EOS ignored); Poisson "
        f"arrivals for {cfg.duration_s:g} simulated s per run, the first {cfg.warmup_s:g} s not measured; "
        f"seed {cfg.seed}; no network delay. Normalized latency = request latency / output tokens; a rate "
        f"is sustained when the mean is <= {cfg.bound_s_per_token * 1e3:g} ms/token. Engines admit FIFO "
        f"under a {engine_config.max_running_tokens:,}-token cap (the baseline's: the whole KV cache; "
        f"baseline_capped's: {manager_config.latency_cap_tokens:,}); Parrot's latency-critical calls keep "
        f"an engine under {manager_config.latency_cap_tokens:,} tokens beyond shared prefixes. Times are "
        "simulated seconds of the latency profile (derived, not measured), except the wall column.\n"
    )
    print(rates_table(searches, cfg) + "\n")
    print(summary_table(searches) + "\n")
    print(engines_table(searches) + "\n")
    print(
        f"{len(points)} simulated runs: {virtual:.0f} simulated s in {wall:.0f} wall s "
        f"({safe_ratio(virtual, wall):.1f}x real time); total {total_s:.0f} wall s"
    )


def json_payload(
    cfg: BenchConfig, workload: Workload, machine: dict[str, Any], searches: dict[str, Search], total_s: float
) -> dict[str, Any]:
    """Every run's figures and what is needed to reproduce or judge them."""
    profile, engine_config, manager_config = policy_setup(BASELINE, cfg)
    return {
        "benchmark": NAME,
        "config": asdict(cfg),
        "profile": asdict(profile),
        "engine_config": {k: str(v) for k, v in asdict(engine_config).items()},
        "manager_config": asdict(manager_config),
        "apps": [{"name": a.name, "system_tokens": a.system_tokens} for a in workload.apps],
        "machine": machine,
        "load_average_1m_at_end": load_average(),
        "policies": {
            policy: {
                "max_sustained_rate": s.best,
                "first_failed_rate": s.first_failed,
                "runs": [p.summary() for p in s.points],
            }
            for policy, s in searches.items()
        },
        "ratios": ratios(searches),
        "paper_anchor": PAPER_ANCHOR,
        "total_s": total_s,
    }


def result_metrics(searches: dict[str, Search], total_s: float) -> dict[str, float | int]:
    """The RESULT line: the four highest sustained rates, Parrot's ratios over the others, wall time."""
    return {
        "parrot_rate": searches[PARROT].best,
        "baseline_rate": searches[BASELINE].best,
        "no_affinity_rate": searches[NO_AFFINITY].best,
        "no_kernel_rate": searches[NO_KERNEL].best,
        "capped_baseline_rate": searches[CAPPED].best,
        **ratios(searches),
        "total_s": total_s,
    }


# ----------------------------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_size_flags(parser, "5 s runs, 1 bisection (~1 min)")
    parser.add_argument("--duration", type=float, help="simulated seconds of arrivals per run")
    parser.add_argument("--warmup", type=float, help="simulated seconds of arrivals not measured")
    parser.add_argument("--bound", type=float, help="sustained: mean normalized latency <= this (s/token)")
    parser.add_argument("--rate", type=float, help="measure this rate only (req/s), no search")
    parser.add_argument("--start-rate", type=float, help="first rate of the grid (req/s)")
    parser.add_argument("--bisect-steps", type=int, help="bisections after the grid")
    parser.add_argument("--baseline-cap", type=int, help="engines' FIFO token cap (default: the KV cache)")
    parser.add_argument("--latency-cap", type=int, help="the manager's latency_cap_tokens (default 4096)")
    parser.add_argument("--engines", type=int, help="simulated engines (default 4)")
    parser.add_argument("--seed", type=int, help="workload seed")
    parser.add_argument(
        "--apps",
        type=int,
        help="number of apps (default 4); their system prompts cycle through 1k, 3k, 5k, 7k tokens",
    )
    parser.add_argument(
        "--policies", help=f"comma-separated subset of {','.join(POLICIES)} (parrot always runs)"
    )
    return parser.parse_args(argv)


def build_config(args: argparse.Namespace) -> BenchConfig:
    return sized(
        args,
        FULL,
        QUICK,
        TINY,
        duration_s=args.duration,
        warmup_s=args.warmup,
        bound_s_per_token=args.bound,
        fixed_rate=args.rate,
        start_rate=args.start_rate,
        bisect_steps=args.bisect_steps,
        baseline_cap=args.baseline_cap,
        latency_cap=args.latency_cap,
        engines=args.engines,
        seed=args.seed,
        system_tokens=None if args.apps is None else app_sizes(args.apps),
    )


def select_policies(spec: str | None) -> list[str]:
    if not spec:
        return list(POLICIES)
    wanted = {p.strip() for p in spec.split(",") if p.strip()} | {PARROT}
    if unknown := wanted - set(POLICIES):
        raise SystemExit(f"unknown policies {sorted(unknown)}; choose from {list(POLICIES)}")
    return [p for p in POLICIES if p in wanted]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    cfg = build_config(args)
    policies = select_policies(args.policies)
    started = time.perf_counter()
    machine = machine_info()
    workload = make_workload(cfg)
    log(f"apps of {[a.system_tokens for a in workload.apps]} system tokens; {cfg.duration_s:g} s per run")
    searches: dict[str, Search] = {}
    for policy in policies:
        log(f"{policy}:")
        searches[policy] = find_max_rate(policy, workload, cfg)
    for policy in POLICIES:  # a policy left out reports NaN
        searches.setdefault(policy, Search(policy, [], math.nan, math.nan))
    total_s = time.perf_counter() - started
    print_report(cfg, workload, machine, searches, total_s)
    if args.json:
        write_json(args.json, json_payload(cfg, workload, machine, searches, total_s))
    print(result_line(NAME, result_metrics(searches, total_s)))


def plot(payload: dict[str, Any], path: Path) -> None:
    """Fig. 17 from a results payload: mean normalized latency against request rate for every policy, the
    latency bound, and each policy's highest sustained rate."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    for policy, search in payload["policies"].items():
        runs = sorted(search["runs"], key=lambda r: r["rate"])
        line = ax.plot([r["rate"] for r in runs], [1000 * r["mean_s_per_token"] for r in runs], "o-", ms=3)
        ax.axvline(search["max_sustained_rate"], color=line[0].get_color(), ls=":", lw=1)
        line[0].set_label(f"{policy} (max {search['max_sustained_rate']:.1f} req/s)")
    ax.axhline(1000 * payload["config"]["bound_s_per_token"], color="grey", ls="--", lw=1, label="bound")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("request rate (req/s, simulated)")
    ax.set_ylabel("mean latency per output token (ms)")
    ax.legend(fontsize=7)
    save(fig, path)


if __name__ == "__main__":
    main()
