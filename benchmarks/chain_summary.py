"""Chain summarization (the Parrot paper's Fig. 11, 12 and 13): Parrot vs a request-centric baseline, one run.

The application is `benchmarks.chain_dependent`'s chain summary — step *i* reads the summary written by step
*i - 1* plus document chunk *i* (stdlib docstrings) and writes the next summary, greedy, EOS ignored — with
its two main clients, reused as they are (`chain_dependent.run_parrot`, `chain_dependent.run_baseline`):

* **parrot** — every step queued in one ``P.Session``, then one ``get(criteria=P.LATENCY)`` of the last
  summary: the server runs the dependent steps back to back, with no client in between.
* **baseline** — what a LangChain app does against an OpenAI-style service: render the prompt, ``POST
  /v1/completions``, wait for the answer, render the next prompt — one client round trip per step.

Every measurement has the simulated client network delay on (``U(0.2, 0.3)`` s per HTTP request,
`server.netdelay`, the paper's 200-300 ms), for both clients and for the background client. One server and
one engine serve the whole run. The engine admits requests FIFO under a running-token cap
(``EngineConfig.max_running_tokens``, the request-centric baseline's latency cap; ``--max-running-tokens``):
a lone chain never reaches it, the background load and many concurrent apps do, so a request arriving at
a busy engine waits in its queue behind what came earlier — the same queue for both clients, since the
OpenAI endpoints and Parrot's steps run on the same engine. Four experiments:

1. **Output length** (Fig. 11a): summary tokens per step swept at a fixed chunk size.
2. **Chunk size** (Fig. 11b): document tokens per step swept at a fixed output length.
3. **Background load** (Fig. 12a): the chain at the fixed point while a background client keeps ``K``
   independent ``/v1/completions`` requests in flight (`BackgroundLoad`: each answered one is replaced at
   once) for the whole measurement of both clients.
4. **Concurrent apps** (Fig. 12b and 13): ``A`` chain-summary apps, each over its own part of the document,
   started together (a barrier); per app its end-to-end latency; per client the mean and p90 over the apps,
   and per app the baseline's latency minus Parrot's (Fig. 13: the paper's apps all finish earlier).

Latency of one chain is from its first request to the last summary in the client's hands (Parrot: session
creation included, its ``DELETE`` after the result not). Figures are medians over ``--repeats`` runs per
client, clients interleaved (alternating which goes first), after an untimed run that also gives the
expected outputs; a run whose last summary differs stops the benchmark (greedy on both sides). Before any
timing, every step's output of the Parrot chain is checked equal to the baseline's
(`chain_dependent.verify`). Speedup = baseline median latency / Parrot's (apps: of the mean per app).

    python -m benchmarks.chain_summary [--quick | --tiny] [--json PATH] [--model PATH] [--repeats N]
        [--steps N] [--outs 16,32,64] [--chunks 64,128,256] [--background 4,8] [--apps 4,8]
    (or python benchmarks/chain_summary.py ...; an empty list, e.g. ``--apps ""``, skips that sweep)

The last line is ``RESULT chain_summary speedup_min=... speedup_max=... speedup_out<N>=...
speedup_chunk<N>=... speedup_bg<K>=... speedup_apps<A>=... speedup_apps<A>_p90=... total_s=...``
(``speedup_min`` / ``speedup_max``: over every ``speedup_*`` on the line).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

if not __package__:
    # Run as a file, this script's directory would come first on sys.path (where `benchmarks/kernels.py`
    # shadows the `kernels` package); put the repository root there instead.
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import httpx

from benchmarks import chain_dependent as cd
from benchmarks.common import (
    Spread,
    add_engine_flags,
    add_size_flags,
    document_chunks,
    int_list,
    load_average,
    log,
    machine_info,
    markdown_table,
    percentile,
    result_line,
    safe_ratio,
    set_threads,
    sized,
    write_json,
)
from benchmarks.plotting import pyplot, save
from server.engine import EngineConfig

NAME = "chain_summary"

PARROT = cd.PARROT
BASELINE = cd.BASELINE
CLIENTS = (PARROT, BASELINE)

# The background client's prompt: an instruction before a document part (no Parrot template: these are
# plain requests of other users of the service).
BACKGROUND_INSTRUCTION = "Summarize the following text.\n\n"

# The paper's figures (OSDI'24, §8.2; one A100, LLaMA 13B, documents of 20k+ tokens), cited as "paper".
PAPER_ANCHORS: dict[str, Any] = {
    "fig11a_output_length": {"vs_vllm_max": 1.38, "vs_huggingface_max": 1.88},
    "fig11b_chunk_size": {"vs_vllm": 1.2, "vs_huggingface": 1.66},
    "fig12a_background": {"vs_vllm": 2.38},
    "fig12b_apps_mean": {"vs_vllm": 1.68},
    "fig13_apps": "25 concurrent apps: every app finishes earlier with Parrot",
}


@dataclass(frozen=True)
class SummaryConfig:
    """What one run measures (the sweeps, and the sizes every point shares)."""

    steps: int = 10
    repeats: int = 3
    outs: tuple[int, ...] = (16, 32, 64)  # Fig. 11a: output tokens per step, at `fixed_chunk`
    chunks: tuple[int, ...] = (64, 128, 256)  # Fig. 11b: document tokens per step, at `fixed_out`
    fixed_out: int = 32
    fixed_chunk: int = 128
    background: tuple[int, ...] = (4, 8)  # Fig. 12a: background requests kept in flight
    apps: tuple[int, ...] = (4, 8)  # Fig. 12b / 13: concurrent chain-summary apps
    background_prompt_tokens: int = 256
    background_max_tokens: int = 64
    # The engine's FIFO running-token cap: above a lone chain's step, below the background load's.
    max_running_tokens: int = 1024
    num_kv_blocks: int = 2048
    delay_low_s: float = 0.2
    delay_high_s: float = 0.3
    seed: int = 0

    def point(self, max_tokens: int, chunk_tokens: int) -> cd.BenchConfig:
        """`chain_dependent`'s configuration of one chain of this run."""
        return cd.BenchConfig(
            steps=self.steps,
            chunk_tokens=chunk_tokens,
            max_tokens=max_tokens,
            repeats=self.repeats,
            delay_low_s=self.delay_low_s,
            delay_high_s=self.delay_high_s,
            seed=self.seed,
        )

    def chain_points(self) -> list[tuple[int, int]]:
        """Every (output tokens, chunk tokens) of sweeps 1 and 2, each once (the fixed point is in both)."""
        points = [(o, self.fixed_chunk) for o in self.outs] + [(self.fixed_out, c) for c in self.chunks]
        return list(dict.fromkeys(points))

    def engine_config(self) -> EngineConfig:
        return EngineConfig(num_kv_blocks=self.num_kv_blocks, max_running_tokens=self.max_running_tokens)


FULL = SummaryConfig()
QUICK = SummaryConfig(
    steps=5,
    repeats=2,
    outs=(8, 16),
    chunks=(32, 64),
    fixed_out=8,
    fixed_chunk=32,
    background=(4,),
    apps=(2, 4),
    background_prompt_tokens=128,
    background_max_tokens=32,
    max_running_tokens=512,
)
TINY = replace(
    QUICK, steps=2, repeats=1, outs=(8,), chunks=(32,), background=(2,), apps=(2,), background_max_tokens=8
)


# ----------------------------------------------------------------------------------------------- background
class BackgroundLoad:
    """Keeps ``in_flight`` independent requests outstanding until stopped: one thread per slot, each sending
    its next request as soon as its last one is answered (a closed loop, as many busy users would).

    ``make_client`` gives each slot its own ``httpx.Client`` (with the server's base URL); slot *i* sends
    ``bodies[i % len(bodies)]`` to ``path``. Use as a context manager: entering starts the slots, leaving
    stops them (each finishes the request it has in flight) and re-raises the first error a slot met.
    """

    def __init__(
        self,
        make_client: Callable[[], httpx.Client],
        bodies: Sequence[dict[str, Any]],
        in_flight: int,
        path: str = "/v1/completions",
    ) -> None:
        if in_flight < 1 or not bodies:
            raise ValueError("a background load needs at least one slot and one request body")
        self.make_client = make_client
        self.bodies = list(bodies)
        self.in_flight = in_flight
        self.path = path
        self.completed = 0
        self.max_in_flight = 0  # the most requests outstanding at once, as counted here
        self._outstanding = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._error: BaseException | None = None

    @property
    def outstanding(self) -> int:
        """Requests sent and not yet answered right now."""
        with self._lock:
            return self._outstanding

    def _slot(self, index: int) -> None:
        body = self.bodies[index % len(self.bodies)]
        try:
            with self.make_client() as client:
                while not self._stop.is_set():
                    with self._lock:
                        self._outstanding += 1
                        self.max_in_flight = max(self.max_in_flight, self._outstanding)
                    try:
                        client.post(self.path, json=body).raise_for_status()
                    finally:
                        with self._lock:
                            self._outstanding -= 1
                    with self._lock:
                        self.completed += 1
        except BaseException as e:  # kept for __exit__: a load that silently stopped would flatter Parrot
            with self._lock:
                self._error = self._error or e
            self._stop.set()

    def __enter__(self) -> BackgroundLoad:
        self._stop.clear()
        self._threads = [
            threading.Thread(target=self._slot, args=(i,), name=f"background-{i}", daemon=True)
            for i in range(self.in_flight)
        ]
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=300)
        if self._error is not None:
            raise RuntimeError(f"a background request failed: {self._error!r}") from self._error


def background_bodies(model_name: str, texts: Sequence[str], max_tokens: int) -> list[dict[str, Any]]:
    """One ``/v1/completions`` body per text: summarize it, greedy, exactly ``max_tokens`` tokens."""
    return [
        {
            "model": model_name,
            "prompt": BACKGROUND_INSTRUCTION + text,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
        }
        for text in texts
    ]


# ----------------------------------------------------------------------------------------------- results
@dataclass
class ChainPoint:
    """One chain configuration (a point of sweep 1, 2 or 3) measured for both clients."""

    max_tokens: int
    chunk_tokens: int
    setting: cd.SettingResult
    background: int = 0  # requests kept in flight by the background client (0: none)
    background_completed: int = 0
    background_max_in_flight: int = 0

    @property
    def speedup(self) -> float:
        return self.setting.speedup(PARROT)

    def as_dict(self) -> dict[str, Any]:
        lo, hi = self.setting.speedup_range(PARROT)
        clients: dict[str, Any] = {}
        for name, c in self.setting.clients.items():
            clients[name] = {"latency": c.spread.as_dict(), "seconds": c.seconds}
            if not self.background:  # with a background load the delay counter also counts its requests
                clients[name]["requests_per_chain"] = c.requests
        out: dict[str, Any] = {
            "max_tokens": self.max_tokens,
            "chunk_tokens": self.chunk_tokens,
            "clients": clients,
            "speedup": self.speedup,
            "speedup_range": [lo, hi],
        }
        if self.background:
            out |= {
                "background_in_flight": self.background,
                "background_completed": self.background_completed,
                "background_max_in_flight": self.background_max_in_flight,
            }
        return out


@dataclass
class AppsClient:
    """One client's runs of ``A`` concurrent apps: ``runs[r][a]`` is app *a*'s latency in run *r*."""

    runs: list[list[float]] = field(default_factory=list)

    @property
    def mean(self) -> Spread:
        return Spread.of(statistics.fmean(r) for r in self.runs)

    @property
    def p90(self) -> Spread:
        return Spread.of(percentile(r, 90) for r in self.runs)

    def per_app_median(self) -> list[float]:
        return [statistics.median(col) for col in zip(*self.runs, strict=True)]


@dataclass
class AppsPoint:
    """``apps`` concurrent chain-summary apps, measured for both clients (sweep 4)."""

    apps: int
    clients: dict[str, AppsClient]

    @property
    def speedup(self) -> float:
        """Baseline over Parrot, median over runs of the mean latency per app."""
        return safe_ratio(self.clients[BASELINE].mean.median, self.clients[PARROT].mean.median)

    @property
    def speedup_p90(self) -> float:
        return safe_ratio(self.clients[BASELINE].p90.median, self.clients[PARROT].p90.median)

    def per_app_difference(self) -> list[float]:
        """Fig. 13: per app, the baseline's median latency minus Parrot's (positive: Parrot was first)."""
        base, parrot = self.clients[BASELINE].per_app_median(), self.clients[PARROT].per_app_median()
        return [b - p for b, p in zip(base, parrot, strict=True)]

    def as_dict(self) -> dict[str, Any]:
        diff = self.per_app_difference()
        return {
            "apps": self.apps,
            "clients": {
                name: {
                    "mean": c.mean.as_dict(),
                    "p90": c.p90.as_dict(),
                    "per_app_median": c.per_app_median(),
                    "runs": c.runs,
                }
                for name, c in self.clients.items()
            },
            "speedup": self.speedup,
            "speedup_p90": self.speedup_p90,
            "per_app_difference_s": diff,
            "apps_faster_in_parrot": sum(d > 0 for d in diff),
        }


# ----------------------------------------------------------------------------------------------- measuring
@dataclass
class Bench:
    """What every measurement shares: the server, a client of it, the run's config and text source."""

    served: cd.Served
    client: httpx.Client
    cfg: SummaryConfig

    def chunks(self, count: int, chunk_tokens: int) -> list[str]:
        return document_chunks(self.served.engine.tokenizer, count, chunk_tokens)

    def make_client(self) -> httpx.Client:
        return httpx.Client(base_url=self.served.url, timeout=300)


def measure_chain(bench: Bench, max_tokens: int, chunk_tokens: int) -> cd.SettingResult:
    """One chain at this point, both clients, with the delay (`chain_dependent.measure_setting`)."""
    point = bench.cfg.point(max_tokens, chunk_tokens)
    chunks = bench.chunks(point.steps, chunk_tokens)
    fns = cd.semantic_functions(point)
    # Untimed, without delay: the expected last summary (every timed run is checked against it).
    expected = cd.run_baseline(bench.served, bench.client, chunks, max_tokens).outputs[-1]
    log(f"chain: {max_tokens} output tokens, chunks of {chunk_tokens} tokens")
    return cd.measure_setting(bench.served, bench.client, fns, chunks, point, True, expected, CLIENTS)


def measure_background(bench: Bench, in_flight: int) -> ChainPoint:
    """The fixed-point chain while `BackgroundLoad` keeps ``in_flight`` requests outstanding throughout."""
    cfg = bench.cfg
    texts = bench.chunks(in_flight, cfg.background_prompt_tokens)
    bodies = background_bodies(bench.served.model_name, texts, cfg.background_max_tokens)
    log(f"background: {in_flight} requests in flight")
    with BackgroundLoad(bench.make_client, bodies, in_flight) as load:
        setting = measure_chain(bench, cfg.fixed_out, cfg.fixed_chunk)
    return ChainPoint(cfg.fixed_out, cfg.fixed_chunk, setting, in_flight, load.completed, load.max_in_flight)


def run_apps_once(
    bench: Bench, runner: Callable[[int, list[str]], cd.ChainRun], app_chunks: list[list[str]]
) -> list[cd.ChainRun]:
    """Every app at once (a barrier releases them together), one thread each; their runs in app order."""
    barrier = threading.Barrier(len(app_chunks))

    def app(index: int) -> cd.ChainRun:
        barrier.wait()
        return runner(index, app_chunks[index])

    with ThreadPoolExecutor(len(app_chunks)) as pool:
        return list(pool.map(app, range(len(app_chunks))))


def measure_apps(bench: Bench, apps: int) -> AppsPoint:
    """``apps`` chains over different parts of the document, started together; both clients interleaved."""
    cfg = bench.cfg
    point = cfg.point(cfg.fixed_out, cfg.fixed_chunk)
    text = bench.chunks(apps * cfg.steps, cfg.fixed_chunk)
    app_chunks = [text[a * cfg.steps : (a + 1) * cfg.steps] for a in range(apps)]
    fns = cd.semantic_functions(point)
    log(f"apps: {apps} concurrent chains")
    with ExitStack() as stack:
        clients = [stack.enter_context(bench.make_client()) for _ in range(apps)]
        runners: dict[str, Callable[[int, list[str]], cd.ChainRun]] = {
            PARROT: lambda i, chunks: cd.run_parrot(bench.served, fns[PARROT], chunks),
            BASELINE: lambda i, chunks: cd.run_baseline(bench.served, clients[i], chunks, cfg.fixed_out),
        }
        # Untimed, without delay: the expected last summary of every app (and a warm-up).
        expected = [r.outputs[-1] for r in run_apps_once(bench, runners[BASELINE], app_chunks)]
        results = {name: AppsClient() for name in CLIENTS}
        bench.served.delay.enabled = True
        try:
            for rep in range(cfg.repeats):
                order = CLIENTS[rep % 2 :] + CLIENTS[: rep % 2]
                for name in order:
                    runs = run_apps_once(bench, runners[name], app_chunks)
                    if [r.outputs[-1] for r in runs] != expected:
                        raise SystemExit(f"{name}: an app's last summary changed between runs")
                    results[name].runs.append([r.seconds for r in runs])
                log(
                    f"  apps {apps} repeat {rep + 1}: "
                    + " | ".join(f"{n} mean {statistics.fmean(r.runs[-1]):.3f}s" for n, r in results.items())
                )
        finally:
            bench.served.delay.enabled = False
    return AppsPoint(apps, results)


@dataclass
class Results:
    """Every sweep's points."""

    chain: dict[tuple[int, int], cd.SettingResult]  # (output tokens, chunk tokens) -> both clients
    background: list[ChainPoint]
    apps: list[AppsPoint]
    verified_steps: int

    def out_sweep(self, cfg: SummaryConfig) -> list[ChainPoint]:
        return [ChainPoint(o, cfg.fixed_chunk, self.chain[o, cfg.fixed_chunk]) for o in cfg.outs]

    def chunk_sweep(self, cfg: SummaryConfig) -> list[ChainPoint]:
        return [ChainPoint(cfg.fixed_out, c, self.chain[cfg.fixed_out, c]) for c in cfg.chunks]


def run_all(bench: Bench) -> Results:
    """Verify once, then every sweep in order on the one server."""
    cfg = bench.cfg
    base = cfg.point(cfg.fixed_out, cfg.fixed_chunk)
    log(f"verifying outputs and warming up ({cfg.steps} steps) ...")
    verified = cd.verify(
        bench.served,
        bench.client,
        cd.semantic_functions(base),
        bench.chunks(cfg.steps, cfg.fixed_chunk),
        base,
    )
    chain = {(o, c): measure_chain(bench, o, c) for o, c in cfg.chain_points()}
    background = [measure_background(bench, k) for k in cfg.background]
    apps = [measure_apps(bench, a) for a in cfg.apps]
    return Results(chain, background, apps, verified)


# ----------------------------------------------------------------------------------------------- report
def _latency(s: Spread) -> str:
    return f"{s.median:.3f} ±{s.rel_half_range:.0%}"


def results_table(cfg: SummaryConfig, res: Results) -> str:
    """One row per point: both clients' median latency (± half the range) and the speedup."""
    rows: list[list[str]] = []

    def chain_row(sweep: str, label: str, p: ChainPoint) -> None:
        lo, hi = p.setting.speedup_range(PARROT)
        rows.append(
            [
                sweep,
                label,
                _latency(p.setting.clients[PARROT].spread),
                _latency(p.setting.clients[BASELINE].spread),
                f"{p.speedup:.2f}x ({lo:.2f}-{hi:.2f})",
            ]
        )

    for p in res.out_sweep(cfg):
        chain_row("11a output length", f"{p.max_tokens} tokens", p)
    for p in res.chunk_sweep(cfg):
        chain_row("11b chunk size", f"{p.chunk_tokens} tokens", p)
    for p in res.background:
        chain_row("12a background", f"{p.background} in flight", p)
    for a in res.apps:
        par, base = a.clients[PARROT], a.clients[BASELINE]
        rows.append(
            [
                "12b/13 apps (mean)",
                f"{a.apps} apps",
                _latency(par.mean),
                _latency(base.mean),
                f"{a.speedup:.2f}x",
            ]
        )
        rows.append(
            [
                "12b/13 apps (p90)",
                f"{a.apps} apps",
                _latency(par.p90),
                _latency(base.p90),
                f"{a.speedup_p90:.2f}x",
            ]
        )
    return markdown_table(
        ["figure", "point", "parrot s", "baseline s", "baseline / parrot (range)"],
        rows,
        [False, False, True, True, True],
    )


def print_report(
    cfg: SummaryConfig, model: str, machine: dict[str, Any], res: Results, total_s: float
) -> None:
    print(
        f"## chain_summary — {model}, {machine['cpu_model']}, {machine['usable_cores']} cores, "
        f"torch {machine['torch']} ({machine['torch_threads']} threads), "
        f"load average {machine['load_average_1m']} at start\n"
    )
    print(
        f"Chain summary of {cfg.steps} dependent steps (greedy, EOS ignored); output length swept at chunks "
        f"of {cfg.fixed_chunk} tokens, chunk size at {cfg.fixed_out} output tokens; background load and "
        f"concurrent apps at ({cfg.fixed_out} output, {cfg.fixed_chunk} chunk tokens). Network delay "
        f"U({cfg.delay_low_s}, {cfg.delay_high_s}) s per request for every client. One engine, FIFO under a "
        f"{cfg.max_running_tokens}-token running cap, {cfg.num_kv_blocks} KV blocks. Background requests: "
        f"{cfg.background_prompt_tokens}-token document part, {cfg.background_max_tokens} output tokens. "
        f"Median of {cfg.repeats} runs per client after an untimed one, ± half the range; outputs of every "
        f"step identical between Parrot and the baseline ({res.verified_steps} steps checked).\n"
    )
    print(results_table(cfg, res) + "\n")
    for a in res.apps:
        diff = a.per_app_difference()
        print(
            f"Fig. 13, {a.apps} apps: baseline minus Parrot latency per app "
            + ", ".join(f"{d:+.2f}s" for d in diff)
            + f" ({sum(d > 0 for d in diff)}/{len(diff)} apps finish earlier with Parrot)"
        )
    print(
        "paper (A100, LLaMA 13B): Fig. 11a up to 1.38x vs vLLM (1.88x vs HuggingFace), Fig. 11b ~1.2x vs "
        "vLLM, Fig. 12a 2.38x with background requests, Fig. 12b 1.68x mean over concurrent apps, Fig. 13 "
        f"every app earlier. total {total_s:.0f}s"
    )


def json_payload(
    cfg: SummaryConfig, model: str, machine: dict[str, Any], res: Results, total_s: float
) -> dict[str, Any]:
    """Every figure, the raw times, and what is needed to reproduce or judge them."""
    return {
        "benchmark": NAME,
        "config": asdict(cfg),
        "model": model,
        "engine_config": {k: str(v) for k, v in asdict(cfg.engine_config()).items()},
        "template": cd.TEMPLATE,
        "machine": machine,
        "load_average_1m_at_end": load_average(),
        "outputs_identical": True,
        "verified_steps": res.verified_steps,
        "network_delay_s": [cfg.delay_low_s, cfg.delay_high_s],
        "sweeps": {
            "output_length": {
                "figure": "11a",
                "chunk_tokens": cfg.fixed_chunk,
                "points": [p.as_dict() for p in res.out_sweep(cfg)],
            },
            "chunk_size": {
                "figure": "11b",
                "max_tokens": cfg.fixed_out,
                "points": [p.as_dict() for p in res.chunk_sweep(cfg)],
            },
            "background": {
                "figure": "12a",
                "max_tokens": cfg.fixed_out,
                "chunk_tokens": cfg.fixed_chunk,
                "background_prompt_tokens": cfg.background_prompt_tokens,
                "background_max_tokens": cfg.background_max_tokens,
                "points": [p.as_dict() for p in res.background],
            },
            "apps": {
                "figure": "12b, 13",
                "max_tokens": cfg.fixed_out,
                "chunk_tokens": cfg.fixed_chunk,
                "points": [a.as_dict() for a in res.apps],
            },
        },
        "paper_anchors": PAPER_ANCHORS,
        "result": result_metrics(cfg, res, total_s),
        "total_s": total_s,
    }


def result_metrics(cfg: SummaryConfig, res: Results, total_s: float) -> dict[str, float | int]:
    """The RESULT line: the headline range of speedups first, then each point's speedup."""
    speedups: dict[str, float] = {}
    for p in res.out_sweep(cfg):
        speedups[f"speedup_out{p.max_tokens}"] = p.speedup
    for p in res.chunk_sweep(cfg):
        speedups[f"speedup_chunk{p.chunk_tokens}"] = p.speedup
    for p in res.background:
        speedups[f"speedup_bg{p.background}"] = p.speedup
    for a in res.apps:
        speedups[f"speedup_apps{a.apps}"] = a.speedup
        speedups[f"speedup_apps{a.apps}_p90"] = a.speedup_p90
    values = [v for v in speedups.values() if math.isfinite(v)]  # NaN (an unusable point): no headline
    return {
        "speedup_min": min(values, default=float("nan")),
        "speedup_max": max(values, default=float("nan")),
        **speedups,
        "total_s": total_s,
    }


def plot(payload: dict[str, Any], path: Path) -> None:
    """The figures as one PNG: latency vs output length, vs chunk size, with background load, vs number of
    apps (mean, p90 as the error bar's top), and per app the baseline's latency minus Parrot's (Fig. 13)."""
    plt = pyplot()

    sweeps = payload["sweeps"]
    colors = {PARROT: "tab:blue", BASELINE: "tab:orange"}
    fig, axes = plt.subplots(1, 5, figsize=(24, 4.5))

    def lines(ax: Any, points: list[dict[str, Any]], key: str, xlabel: str, title: str) -> None:
        for name in CLIENTS:
            xs = [p[key] for p in points]
            lat = [p["clients"][name]["latency"] for p in points]
            med = [d["median"] for d in lat]
            err = [
                [m - d["min"] for m, d in zip(med, lat, strict=True)],
                [d["max"] - m for m, d in zip(med, lat, strict=True)],
            ]
            ax.errorbar(xs, med, yerr=err, marker="o", capsize=3, label=name, color=colors[name])
        ax.set_xlabel(xlabel)
        ax.set_ylabel("end-to-end latency (s)")
        ax.set_title(title)
        ax.set_ylim(bottom=0)
        ax.legend()

    def bars(
        ax: Any, labels: list[str], values: dict[str, list[float]], tops: dict[str, list[float]]
    ) -> None:
        width = 0.38
        for j, name in enumerate(CLIENTS):
            xs = [i + (j - 0.5) * width for i in range(len(labels))]
            low = [0.0] * len(labels)
            high = [max(0.0, t - v) for t, v in zip(tops[name], values[name], strict=True)]
            ax.bar(xs, values[name], width, yerr=[low, high], capsize=3, label=name, color=colors[name])
        ax.set_xticks(range(len(labels)), labels)
        ax.set_ylabel("end-to-end latency (s)")
        ax.legend()

    lines(
        axes[0],
        sweeps["output_length"]["points"],
        "max_tokens",
        "output tokens per step",
        f"11a: chunks of {sweeps['output_length']['chunk_tokens']} tokens",
    )
    lines(
        axes[1],
        sweeps["chunk_size"]["points"],
        "chunk_tokens",
        "chunk tokens per step",
        f"11b: {sweeps['chunk_size']['max_tokens']} output tokens",
    )

    bg = sweeps["background"]["points"]
    bars(
        axes[2],
        [f"{p['background_in_flight']} in flight" for p in bg],
        {n: [p["clients"][n]["latency"]["median"] for p in bg] for n in CLIENTS},
        {n: [p["clients"][n]["latency"]["max"] for p in bg] for n in CLIENTS},
    )
    axes[2].set_title("12a: with background requests")

    apps = sweeps["apps"]["points"]
    bars(
        axes[3],
        [f"{a['apps']} apps" for a in apps],
        {n: [a["clients"][n]["mean"]["median"] for a in apps] for n in CLIENTS},
        {n: [a["clients"][n]["p90"]["median"] for a in apps] for n in CLIENTS},
    )
    axes[3].set_title("12b: concurrent apps (mean, bar to p90)")

    ax = axes[4]
    if apps:
        last = apps[-1]
        diff = last["per_app_difference_s"]
        ax.bar(range(len(diff)), diff, color=["tab:green" if d > 0 else "tab:red" for d in diff])
        ax.set_xticks(range(len(diff)), [str(i + 1) for i in range(len(diff))])
        ax.set_title(f"13: {last['apps']} apps, baseline - parrot latency")
    else:
        ax.set_title("13: no apps measured")
    ax.axhline(0, color="black", linewidth=0.8)
    ax.set_xlabel("app")
    ax.set_ylabel("latency difference (s)")

    fig.suptitle(f"chain summary, {payload['model']}, network delay {payload['network_delay_s']} s")
    save(fig, path)


# ----------------------------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_size_flags(parser, "5 steps, short chunks and outputs, 2 repeats (~1.5 min)")
    add_engine_flags(parser)
    parser.add_argument("--repeats", type=int, help="timed runs per client and point (median)")
    parser.add_argument("--steps", type=int, help="dependent steps per chain")
    parser.add_argument("--outs", type=int_list, help="sweep 1: output tokens per step, e.g. 16,32,64")
    parser.add_argument("--chunks", type=int_list, help="sweep 2: chunk tokens per step, e.g. 64,128,256")
    parser.add_argument("--background", type=int_list, help="sweep 3: background requests in flight")
    parser.add_argument("--apps", type=int_list, help="sweep 4: concurrent apps")
    parser.add_argument("--max-running-tokens", type=int, help="the engine's FIFO running-token cap")
    parser.add_argument("--plot", metavar="PATH", help="also draw the figures as a PNG")
    return parser.parse_args(argv)


def build_config(args: argparse.Namespace) -> SummaryConfig:
    return sized(
        args,
        FULL,
        QUICK,
        TINY,
        repeats=args.repeats,
        steps=args.steps,
        outs=args.outs,
        chunks=args.chunks,
        background=args.background,
        apps=args.apps,
        max_running_tokens=args.max_running_tokens,
    )


@contextmanager
def bench_server(model: str, cfg: SummaryConfig) -> Iterator[Bench]:
    """The one server of the run (`chain_dependent.serve`, delay off until a measurement turns it on)."""
    point = cfg.point(cfg.fixed_out, cfg.fixed_chunk)
    with (
        cd.serve(model, cfg.engine_config(), point) as served,
        httpx.Client(base_url=served.url, timeout=300) as client,
    ):
        yield Bench(served, client, cfg)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    cfg = build_config(args)

    set_threads(args)
    started = time.perf_counter()
    machine = machine_info()
    log(f"starting the server ({args.model}) ...")
    with bench_server(args.model, cfg) as bench:
        res = run_all(bench)
    total_s = time.perf_counter() - started
    print_report(cfg, args.model, machine, res, total_s)
    payload = json_payload(cfg, args.model, machine, res, total_s)
    if args.json:
        write_json(args.json, payload)
    if args.plot:
        plot(payload, Path(args.plot))
    print(result_line(NAME, result_metrics(cfg, res, total_s)))


if __name__ == "__main__":
    main()
