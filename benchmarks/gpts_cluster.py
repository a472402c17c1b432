"""GPTs-like apps on a simulated 4-engine cluster: the highest request rate each policy sustains (Fig. 17).

The paper (section 8.3): four GPTs apps, each with a long system prompt shared by all of its users, on
four LLaMA-7B engines; Parrot sustains 12x the rate of a baseline without sharing, 3x without affinity
scheduling, 2.4x without the shared-prefix kernel. Here the cluster is simulated (`server.sim`: the real
manager, app and scheduler on virtual time, each step timed by the ``a100-llama7b`` profile, derived not
measured), so every figure is simulated seconds of that model.

Workload (`benchmarks.workloads.gpts`): apps with system prompts of about 1k, 3k, 5k and 7k tokens
(``--apps N`` cycles through them); each request picks an app uniformly, a 20-60-token query, 64-128
output tokens; Poisson arrivals at rate R for ``duration`` simulated seconds (request *i* is the same
request at every rate and for every policy); requests arriving in the first ``warmup`` seconds are served
but not measured; every run waits for all its requests. No network delay. A fixed duration, not a fixed
count: a fast policy would absorb a fixed count as one burst without keeping up with the rate; over a
fixed duration an unsustainable rate builds a queue (the ``drain`` column).

Policies, each on a fresh cluster (64k-token KV cache per engine):

* **parrot** — one semantic-function call per request in its own session, ``aget(criteria=P.LATENCY)``;
  the system prompt is a shared context, placed by prefix affinity, decoded with the shared-prefix kernel.
* **parrot_no_affinity** — ``ManagerConfig(prefix_affinity=False)``: placed by load alone.
* **parrot_no_kernel** — the profile's ``shared_prefix_decode=False`` (a shared prefix is read per sequence).
* **baseline** — rendered prompts over ``POST /v1/completions``, nothing shared, least-loaded engine, FIFO
  under the whole KV cache (``--baseline-cap``). **baseline_capped** — FIFO under the latency cap (4096):
  the paper's latency-centric setting; the headline ratio is against the stronger uncapped baseline.

Metric: normalized latency = (completion - arrival) / output tokens. A rate is sustained when the mean
over measured requests is within ``--bound`` (0.04 s/token) and nothing failed. Per policy the highest
sustained rate is searched (`benchmarks.harness.rates`: doubling from 4 req/s, then 3 bisections, quick 1;
``--rate R``: that rate only). RESULT: each policy's rate and Parrot's over each other's, good to about
the last bracket (the "first failed" column).

**Affinity at scale** (``many_apps``, 16; 0: off): parrot and parrot_no_affinity again with 16 apps (~64k
prompt tokens, one engine's whole cache). With the paper's four apps every engine holds every app's prompt
(16k tokens), so placing by load alone loses nothing but reading four prefixes per decode step instead of
one (measured 1.0x); a service holds more apps than engines, and then affinity keeps each engine's share of
the prompts resident where load-only placement evicts and re-prefills them on every engine.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.harness import rate_tables, rates, record, systems
from benchmarks.harness.arrivals import enough_requests
from benchmarks.harness.output import log
from benchmarks.harness.rates import RatePoint, Search, Timed
from benchmarks.harness.sim_runs import SimServed
from benchmarks.harness.stats import safe_ratio
from benchmarks.workloads.gpts import Request, Workload, make_workload
from server.engine.config import EngineConfig
from server.serve.manager import ManagerConfig
from server.sim import LatencyModel, load_profile

NAME = "gpts_cluster"
PARROT, NO_AFFINITY, NO_KERNEL = "parrot", "parrot_no_affinity", "parrot_no_kernel"
BASELINE, CAPPED = "baseline", "baseline_capped"
POLICIES = (PARROT, NO_AFFINITY, NO_KERNEL, BASELINE, CAPPED)
SHORT = {BASELINE: "baseline", NO_AFFINITY: "no_affinity", NO_KERNEL: "no_kernel", CAPPED: "capped_baseline"}
PAPER_ANCHOR = {BASELINE: 12.0, NO_AFFINITY: 3.0, NO_KERNEL: 2.4, CAPPED: 12.0}


@dataclass(frozen=True)
class BenchConfig:
    engines: int = 4
    duration: float = 15.0  # simulated seconds of arrivals per run (one policy at one rate)
    warmup: float = 2.0  # requests arriving before this are served but not measured
    system_tokens: tuple[int, ...] = (1000, 3000, 5000, 7000)
    query_tokens: tuple[int, int] = (20, 60)
    output_tokens: tuple[int, int] = (64, 128)
    bound: float = 0.04  # seconds per output token: the mean a sustained rate stays within
    start_rate: float = 4.0  # requests per simulated second; the grid doubles (or halves) from here
    max_rate: float = 256.0
    min_rate: float = 0.25
    bisect_steps: int = 3
    rate: float | None = None  # measure this rate only (no search)
    baseline_cap: int = 0  # engines' FIFO token cap (0: the whole KV cache)
    latency_cap: int = 4096  # the manager's latency_cap_tokens, and baseline_capped's FIFO cap
    profile: str = "a100-llama7b"
    seed: int = 0
    many_apps: int = 16  # the affinity ablation again with this many apps (0: not run)


FULL = BenchConfig()
QUICK = BenchConfig(duration=5.0, warmup=1.0, bisect_steps=1)
TINY = BenchConfig(duration=2.5, warmup=0.0, rate=4.0)


def app_sizes(apps: int) -> tuple[int, ...]:
    """System-prompt sizes of ``apps`` apps: the paper's four sizes, repeated."""
    if apps < 1:
        raise SystemExit("--apps must be at least 1")
    return tuple(BenchConfig.system_tokens[i % 4] for i in range(apps))


def workload_of(cfg: BenchConfig) -> Workload:
    """Enough requests for the highest rate a run may use (Poisson: a margin above rate x duration)."""
    count = enough_requests(max(cfg.max_rate, cfg.rate or 0.0, cfg.start_rate), cfg.duration)
    lengths = {"query_tokens": cfg.query_tokens, "output_tokens": cfg.output_tokens}
    return make_workload(cfg.system_tokens, count, **lengths, seed=cfg.seed)


# ----------------------------------------------------------------------------------------------- one run
def latency_model(policy: str, cfg: BenchConfig) -> LatencyModel:
    profile = load_profile(cfg.profile)
    return dataclasses.replace(profile, shared_prefix_decode=False) if policy == NO_KERNEL else profile


def policy_system(policy: str, cfg: BenchConfig) -> systems.System:
    """Every policy's engines but baseline_capped's admit FIFO under the same cap (for Parrot it never
    binds), and no policy's OpenAI route caches prefixes: they differ only where named."""
    cap = cfg.latency_cap if policy == CAPPED else cfg.baseline_cap or load_profile(cfg.profile).kv_tokens
    manager = ManagerConfig(
        prefix_affinity=policy != NO_AFFINITY, openai_prefix_cache=False, latency_cap_tokens=cfg.latency_cap
    )
    return systems.System(policy, EngineConfig(device="cpu", max_running_tokens=cap), manager, cfg.engines)


async def send(served: SimServed, workload: Workload, request: Request) -> None:
    """Parrot: one call in its own session, fetched with the latency criteria; the baselines: the whole
    rendered prompt to ``/v1/completions``."""
    if served.system.name in (BASELINE, CAPPED):
        await workload.baseline(served.http, request, model=served.model_name)
    else:
        await workload.parrot(served.http, request)


def run_point(policy: str, rate: float, workload: Workload, cfg: BenchConfig) -> RatePoint:
    """``policy`` at ``rate`` on a fresh simulated cluster."""

    def calls(served: SimServed) -> list[Timed]:
        arrivals = workload.arrivals(rate, cfg.duration)
        return [(at, r.max_tokens, functools.partial(send, served, workload, r)) for r, at in arrivals]

    system, latency = policy_system(policy, cfg), latency_model(policy, cfg)
    return rates.measure(system, latency, rate, calls, cfg.warmup, cfg.bound)


def find_max_rate(policy: str, workload: Workload, cfg: BenchConfig, measure: Any = run_point) -> Search:
    """The highest rate ``policy`` sustains (``measure(policy, rate, workload, cfg)`` per rate tried)."""
    grid = rates.RateGrid(cfg.start_rate, cfg.max_rate, cfg.min_rate, cfg.bisect_steps, cfg.rate)
    return rates.max_sustained_rate(policy, lambda r: measure(policy, r, workload, cfg), grid, cfg.bound)


def affinity_at_scale(cfg: BenchConfig, wanted: set[str]) -> dict[str, Search]:
    """Parrot with and without affinity over ``many_apps`` apps (none when off or not asked for)."""
    if not cfg.many_apps or NO_AFFINITY not in wanted:
        return {}
    scaled = dataclasses.replace(cfg, system_tokens=app_sizes(cfg.many_apps))
    log(f"affinity at scale, {cfg.many_apps} apps ({sum(scaled.system_tokens):,} system-prompt tokens):")
    workload = workload_of(scaled)
    return {policy: find_max_rate(policy, workload, scaled) for policy in (PARROT, NO_AFFINITY)}


# ----------------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> None:
    p = record.parser(
        __doc__,
        "5 s runs, 1 bisection (~1 min)",
        BenchConfig,
        engine=False,
        duration="simulated seconds of arrivals per run",
        warmup="simulated seconds of arrivals not measured",
        bound="sustained: mean normalized latency <= this (s/token)",
        start_rate="first rate of the grid (req/s)",
        bisect_steps="bisections after the grid",
        baseline_cap="engines' FIFO token cap (default: the KV cache)",
        latency_cap="the manager's latency_cap_tokens (default 4096)",
        profile="the simulator's latency profile: a name under server/sim/profiles or a JSON file",
        engines="simulated engines (default 4)",
        seed="workload seed",
        many_apps="apps of the affinity ablation at scale (default 16; 0: off)",
    )
    p.add_argument("--rate", type=float, help="measure this rate only (req/s), no search")
    p.add_argument("--apps", type=int, help="number of apps (default 4): prompts cycle 1k, 3k, 5k, 7k tokens")
    p.add_argument("--policies", help=f"comma-separated subset of {','.join(POLICIES)} (parrot always runs)")
    args = p.parse_args(argv)
    cfg = record.configured(args, FULL, QUICK, TINY)
    if args.apps is not None:
        cfg = dataclasses.replace(cfg, system_tokens=app_sizes(args.apps))
    wanted = {x.strip() for x in (args.policies or ",".join(POLICIES)).split(",") if x.strip()} | {PARROT}
    if unknown := wanted - set(POLICIES):
        raise SystemExit(f"unknown policies {sorted(unknown)}; choose from {list(POLICIES)}")
    rec = record.Recorder(NAME, args)
    workload = workload_of(cfg)
    log(f"apps of {[a.system_tokens for a in workload.apps]} system tokens; {cfg.duration:g} s per run")
    searches: dict[str, Search] = {}
    for policy in POLICIES:  # a policy left out reports NaN
        searches[policy] = Search(policy, [], math.nan, math.nan)
        if policy in wanted:
            log(f"{policy}:")
            searches[policy] = find_max_rate(policy, workload, cfg)
    at_scale = affinity_at_scale(cfg, wanted)

    kv = load_profile(cfg.profile).kv_tokens
    print(rec.header(f"simulated {cfg.engines} engines, profile {cfg.profile} ({kv:,}-token KV cache each)"))
    print(
        f"Apps with system prompts of {[a.system_tokens for a in workload.apps]} tokens; queries of "
        f"{cfg.query_tokens} tokens, outputs of {cfg.output_tokens} (EOS ignored); Poisson arrivals for "
        f"{cfg.duration:g} simulated s per run, the first {cfg.warmup:g} s not measured; seed {cfg.seed}; no "
        f"network delay. Sustained: mean latency per output token <= {cfg.bound * 1e3:g} ms. FIFO caps: "
        f"{cfg.baseline_cap or kv:,} tokens (baseline_capped: {cfg.latency_cap:,}); Parrot's latency cap "
        f"{cfg.latency_cap:,}. Simulated seconds of the profile (derived, not measured), except wall.\n"
    )
    print(rate_tables.report(searches, PARROT, PAPER_ANCHOR, cfg.bound))
    best = searches[PARROT].best
    ratios = {f"speedup_vs_{short}": safe_ratio(best, searches[p].best) for p, short in SHORT.items()}
    scale = {p: at_scale[p].best if at_scale else math.nan for p in (PARROT, NO_AFFINITY)}
    ratios["speedup_vs_no_affinity_many_apps"] = safe_ratio(scale[PARROT], scale[NO_AFFINITY])
    if at_scale:
        print(f"\n### Affinity at scale: {cfg.many_apps} apps\n")
        print(rate_tables.report(at_scale, PARROT, {NO_AFFINITY: PAPER_ANCHOR[NO_AFFINITY]}, cfg.bound))
    rec.finish(
        {
            "parrot_rate": best,
            **{f"{short}_rate": searches[p].best for p, short in SHORT.items()},
            "parrot_rate_many_apps": scale[PARROT],
            "no_affinity_rate_many_apps": scale[NO_AFFINITY],
            **ratios,
        },
        config=cfg,
        profile=load_profile(cfg.profile),
        systems={p: policy_system(p, cfg).describe() for p in POLICIES},
        apps=[{"name": a.name, "system_tokens": a.system_tokens} for a in workload.apps],
        policies={p: s.as_dict() for p, s in searches.items()},
        many_apps={p: s.as_dict() for p, s in at_scale.items()},
        ratios=ratios,
        paper_anchor=PAPER_ANCHOR,
    )


def plot(payload: dict[str, Any], path: Path) -> None:
    """Fig. 17: mean normalized latency against request rate per policy, the bound, each policy's highest
    sustained rate."""
    rate_tables.plot(payload["policies"], payload["config"]["bound"], path)


if __name__ == "__main__":
    main()
