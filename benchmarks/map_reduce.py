"""Map-reduce summary of a long document: Parrot vs a latency-capped request-centric baseline, one run.

The application (Fig. 14 of the Parrot paper, anchor 2.37x on one A100 engine): a long document (stdlib
docstrings, `benchmarks.common.document_chunks`) cut into ``chunks`` parts of ``chunk_tokens`` tokens; one
*map* call per part writes its summary (``map_tokens`` tokens), then one *reduce* call reads all the
summaries and writes the summary of the whole document (``reduce_tokens`` tokens). Greedy sampling with EOS
ignored, so every call writes exactly its token budget. Two clients, each a plain ``async`` function over an
``httpx.AsyncClient`` (so the same code can drive an in-process app on a virtual clock):

* **parrot** (`parrot_map_reduce`) — the `parrot` frontend: in one session, the map calls and the reduce call
  (whose inputs are the map calls' output variables) are queued, then one ``aget(criteria=P.LATENCY)`` of the
  reduce output sends the whole DAG in one batch request. Objective deduction puts the map calls in one task
  group (their consumer waits for the slowest), which the scheduler places together as one large batch.
* **baseline** (`baseline_map_reduce`) — what a LangChain app does against an OpenAI-style service: the
  client renders the map prompts itself and sends them as concurrent ``POST /v1/completions``
  (``asyncio.gather``), waits for all the answers, renders the reduce prompt from them and sends it. The
  service sees isolated requests and treats each as latency-critical: its engine admits requests FIFO under
  a running-token cap (`EngineConfig.max_running_tokens`, the sum of the running requests' prompt +
  ``max_tokens``), the paper's latency-centric baseline (there 4096 tokens on an A100), scaled here so only
  a few map requests run at once.

Both clients run on the same server code, in one process: two `server.launch` servers, one engine each, with
the same `EngineConfig` except that the baseline's engine has ``max_running_tokens=latency_cap_tokens``;
the Parrot server's manager gets ``ManagerConfig(latency_cap_tokens=latency_cap_tokens)`` and no engine cap,
so the same latency cap binds its latency-bound work (the reduce call), while the map stage's task group is
placed like throughput work, capped only by the engine's capacity (its KV cache): all map calls run in one
batch. Before timing, the final summary of both clients is checked to be identical
(greedy on both sides; the reduce prompt contains every map summary, so a difference anywhere shows); a
difference stops the run.

End-to-end latency of one run is measured from the client's first request to the final summary in its
hands (Parrot: session creation included, the session's ``DELETE`` after the result not). Two settings:
without network delay, and with a simulated client network delay of ``U(0.2, 0.3)`` s per HTTP request
(`server.netdelay`, switched on at run time, on both servers). Figures are medians over ``--repeats`` runs
per client, clients interleaved (alternating which goes first), after an untimed warm-up; the spread
(``±``) is half the range. Per client, the table also shows the engine's work per run (steps, prefill
tokens, decode tokens per step), which is where the time goes: on a CPU the tiny model's decode step costs
about the same (~5-8 ms, mostly per-step overhead) for 2 or 16 sequences, much as a GPU's does, so the
speedup follows the ratio of engine steps, diluted by the prefill and the reduce stage (the same work for
both clients) and by the network delay (two sequential round trips for each client).

**At GPU scale, on the simulator** (`server.sim`): the same two client functions drive the real manager and
app over one simulated engine with the ``a100-llama7b`` latency profile (given as data: derived from an
A100's datasheet roofline for LLaMA-7B, not measured), on virtual time — the paper's setting: a
``sim_chunks`` x 1024-token document, map summaries of 50 and of 100 tokens (Fig. 14 varies the output
length; the longer the outputs, the more of the job is decoding, where batch size pays), the baseline
engine capped at 4096
running tokens (the paper's latency cap), Parrot's manager given the same latency cap, the same
``U(0.2, 0.3)`` s network delay. The simulation is deterministic (one run per client); outputs are checked
identical there too.

    python -m benchmarks.map_reduce [--quick] [--json PATH] [--repeats N] [--chunks N] ...
    (or python benchmarks/map_reduce.py ...)

The last line is ``RESULT map_reduce speedup=... speedup_nodelay=... parrot_s=... baseline_s=...
parrot_nodelay_s=... baseline_nodelay_s=... sim_speedup_out50=... sim_speedup_out100=... ... total_s=...``
(speedup = baseline / parrot median latency with the delay; ``*_nodelay`` without; ``sim_*``: on the
simulator with the GPU profile, by map output length, with the simulated seconds of each client).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import statistics
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
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
    ClientResult,
    Spread,
    add_engine_flags,
    add_size_flags,
    document_chunks,
    load_average,
    log,
    machine_info,
    markdown_table,
    render_template,
    result_line,
    safe_ratio,
    set_threads,
    sized,
    write_json,
)
from benchmarks.plotting import pyplot, save
from server.engine import EngineConfig
from server.launcher import LaunchedServer, launch
from server.serve.manager import ManagerConfig

NAME = "map_reduce"
PARROT = "parrot"
BASELINE = "baseline"
CLIENTS = (PARROT, BASELINE)
PAPER_ANCHOR = 2.37  # Fig. 14: one A100 engine, LLaMA 13B, baseline capped at 4096 running tokens

MAP_TEMPLATE = """Summarize this part of a long document in a few sentences.
Part of the document:
{{input:chunk}}
Summary of this part: {{output:summary}}"""

REDUCE_HEAD = "Summaries of the parts of a long document, in order:"
REDUCE_TAIL = "Summary of the whole document: {{output:summary}}"

OnResult = Callable[[str], None]


# ----------------------------------------------------------------------------------------------- the app
@dataclass(frozen=True)
class MapReduceDoc:
    """One map-reduce job: the document's parts and the token budgets of the map and reduce calls."""

    chunks: tuple[str, ...]
    map_tokens: int
    reduce_tokens: int

    @property
    def reduce_template(self) -> str:
        """The reduce call's template: one input per part's summary, in order."""
        parts = [f"{{{{input:part{i}}}}}" for i in range(len(self.chunks))]
        return "\n".join([REDUCE_HEAD, *parts, REDUCE_TAIL])

    def map_prompt(self, chunk: str) -> str:
        """The rendered prompt of one map call (what the baseline sends; Parrot's server renders the same)."""
        return render_template(MAP_TEMPLATE, {"chunk": chunk})

    def reduce_prompt(self, summaries: Sequence[str]) -> str:
        """The rendered prompt of the reduce call over the parts' summaries."""
        return render_template(self.reduce_template, {f"part{i}": s for i, s in enumerate(summaries)})

    def sampling(self, max_tokens: int) -> dict[str, Any]:
        """Greedy, EOS ignored: every call writes exactly ``max_tokens`` tokens (both clients)."""
        return {"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}


def make_doc(
    tokenizer: Any, chunks: int, chunk_tokens: int, map_tokens: int, reduce_tokens: int
) -> MapReduceDoc:
    """The job over ``chunks`` consecutive parts of the stdlib text, ``chunk_tokens`` tokens each."""
    parts = document_chunks(tokenizer, chunks, chunk_tokens)
    return MapReduceDoc(tuple(parts), map_tokens, reduce_tokens)


async def parrot_map_reduce(
    client: httpx.AsyncClient,
    doc: MapReduceDoc,
    *,
    criteria: Criteria = "latency",
    timeout: float = 300.0,
    on_result: OnResult | None = None,
) -> str:
    """The map-reduce job through the `parrot` frontend on the server at ``client.base_url``.

    One session: the map calls and the reduce call are queued, and the ``aget`` of the reduce output (with
    ``criteria``: latency for a user waiting, throughput for a batch job) sends them with the get in one
    batch request. ``on_result`` is called with the final summary as soon as it is in hand (before the
    session's delete), for timing.
    """
    summarize = P.SemanticFunction.from_template(
        MAP_TEMPLATE, name="summarize_part", sampling=P.SamplingConfig(**doc.sampling(doc.map_tokens))
    )
    combine = P.SemanticFunction.from_template(
        doc.reduce_template, name="combine", sampling=P.SamplingConfig(**doc.sampling(doc.reduce_tokens))
    )
    async with P.Session(str(client.base_url), client=client, timeout=timeout):
        summaries = [summarize(chunk=chunk) for chunk in doc.chunks]
        final = combine(**{f"part{i}": s for i, s in enumerate(summaries)})
        assert isinstance(final, P.Variable)
        value = await final.aget(criteria=criteria)
        if on_result is not None:
            on_result(value)
    return value


async def baseline_map_reduce(
    client: httpx.AsyncClient,
    doc: MapReduceDoc,
    *,
    model: str | None = None,
    on_result: OnResult | None = None,
) -> str:
    """The map-reduce job as a request-centric client runs it: concurrent ``/v1/completions`` for the map
    prompts (rendered client-side), then one for the reduce prompt rendered from their answers."""

    async def complete(prompt: str, max_tokens: int) -> str:
        body: dict[str, Any] = {"prompt": prompt, **doc.sampling(max_tokens)}
        if model is not None:
            body["model"] = model
        response = await client.post("/v1/completions", json=body)
        response.raise_for_status()
        return str(response.json()["choices"][0]["text"])

    summaries = await asyncio.gather(*(complete(doc.map_prompt(c), doc.map_tokens) for c in doc.chunks))
    value = await complete(doc.reduce_prompt(summaries), doc.reduce_tokens)
    if on_result is not None:
        on_result(value)
    return value


# ----------------------------------------------------------------------------------------------- simulator
SIM_OUTPUT_TOKENS = (50, 100)  # map summary lengths simulated


@dataclass(frozen=True)
class SimConfig:
    """The GPU-scale job on the simulator (see the module docstring)."""

    chunks: int = 32
    chunk_tokens: int = 1024
    map_tokens: int = 50
    reduce_tokens: int = 100
    latency_cap_tokens: int = 4096
    profile: str = "a100-llama7b"


@dataclass(frozen=True)
class SimResult:
    parrot_s: float
    baseline_s: float
    parrot_steps: int
    baseline_steps: int

    @property
    def speedup(self) -> float:
        return safe_ratio(self.baseline_s, self.parrot_s)


def simulate(cfg: SimConfig) -> SimResult:
    """Run each client once on a simulated engine with the GPU profile (virtual seconds)."""
    from server.sim import load_profile, run, sim_cluster, tiny_tokenizer

    latency = load_profile(cfg.profile)
    doc = make_doc(tiny_tokenizer(), cfg.chunks, cfg.chunk_tokens, cfg.map_tokens, cfg.reduce_tokens)
    # 4096 tokens per step, like a GPU engine's prefill chunk; the caps are what differs between clients.
    base = EngineConfig(device="cpu", max_num_batched_tokens=4096, max_num_seqs=256)
    setups = {
        PARROT: (base, ManagerConfig(latency_cap_tokens=cfg.latency_cap_tokens), parrot_map_reduce),
        BASELINE: (
            replace(base, max_running_tokens=cfg.latency_cap_tokens),
            ManagerConfig(openai_prefix_cache=False),  # baseline: no OpenAI-route cache
            baseline_map_reduce,
        ),
    }

    async def one(client: str) -> tuple[str, float, int]:
        engine_config, manager_config, app = setups[client]
        async with sim_cluster(
            1, latency, engine_config=engine_config, manager_config=manager_config, network_delay=(0.2, 0.3)
        ) as cluster:
            start = cluster.now()
            value = await app(cluster.client, doc)
            return value, cluster.now() - start, cluster.engines[0].stats().steps

    results = {client: run(one(client)) for client in CLIENTS}
    if results[PARROT][0] != results[BASELINE][0]:
        raise SystemExit("simulator: the two clients' final summaries differ")
    return SimResult(results[PARROT][1], results[BASELINE][1], results[PARROT][2], results[BASELINE][2])


# ----------------------------------------------------------------------------------------------- config
@dataclass(frozen=True)
class BenchConfig:
    """What one run measures."""

    chunks: int = 16  # map calls
    chunk_tokens: int = 256  # document tokens per map call
    map_tokens: int = 48  # summary tokens per map call
    reduce_tokens: int = 48  # tokens of the final summary
    # The latency cap (running tokens: prompt + max_tokens): the baseline engine's FIFO admission cap and
    # the Parrot manager's cap for latency-critical work. ~3 map requests (~330 tokens each) fit under it,
    # and so does the reduce request (~16 x 50 summary tokens + template + max_tokens).
    latency_cap_tokens: int = 1024
    num_kv_blocks: int = 1024  # per engine, 16-token blocks: room for every map request at once
    repeats: int = 5
    delay_low_s: float = 0.2
    delay_high_s: float = 0.3
    seed: int = 0


FULL = BenchConfig()
QUICK = BenchConfig(chunks=8, latency_cap_tokens=768, repeats=3)
TINY = BenchConfig(chunks=2, chunk_tokens=16, map_tokens=4, reduce_tokens=4, repeats=1)


# ----------------------------------------------------------------------------------------------- servers
@dataclass
class Servers:
    """The two servers of one run (one engine each) and their HTTP clients."""

    parrot: LaunchedServer
    baseline: LaunchedServer
    clients: dict[str, httpx.AsyncClient] = field(default_factory=dict)

    def of(self, client: str) -> LaunchedServer:
        return self.parrot if client == PARROT else self.baseline

    def set_delay(self, enabled: bool) -> None:
        for served in (self.parrot, self.baseline):
            assert served.network_delay is not None
            served.network_delay.enabled = enabled


def engine_configs(cfg: BenchConfig) -> tuple[EngineConfig, EngineConfig]:
    """(Parrot's, the baseline's): identical but for the baseline's FIFO running-token cap."""
    base = EngineConfig(num_kv_blocks=cfg.num_kv_blocks)
    return base, replace(base, max_running_tokens=cfg.latency_cap_tokens)


@contextlib.contextmanager
def serve(model: str, cfg: BenchConfig) -> Iterator[Servers]:
    """Both servers, their delay middleware switched off."""
    parrot_engine, baseline_engine = engine_configs(cfg)
    common: dict[str, Any] = {
        "startup_timeout": 120,
        "network_delay": (cfg.delay_low_s, cfg.delay_high_s),
        "network_delay_seed": cfg.seed,
    }
    with (
        launch(
            model,
            engine_config=parrot_engine,
            manager_config=ManagerConfig(latency_cap_tokens=cfg.latency_cap_tokens),
            **common,
        ) as parrot_server,
        launch(
            model,
            engine_config=baseline_engine,
            manager_config=ManagerConfig(openai_prefix_cache=False),  # baseline: no OpenAI-route cache
            **common,
        ) as baseline_server,
    ):
        servers = Servers(parrot_server, baseline_server)
        servers.set_delay(False)
        yield servers


# ----------------------------------------------------------------------------------------------- measuring
@dataclass
class Run:
    """One job: latency to the final summary, the summary, HTTP requests made and the engine's work."""

    seconds: float
    output: str
    requests: int
    engine: dict[str, int]


ENGINE_COUNTERS = ("steps", "prefill_tokens_computed", "decode_tokens_computed", "preemptions")


def engine_counters(served: LaunchedServer) -> dict[str, int]:
    stats = served.engines[0].stats()
    return {name: int(getattr(stats, name)) for name in ENGINE_COUNTERS}


def runner(servers: Servers, client: str, doc: MapReduceDoc) -> Callable[[OnResult], Awaitable[str]]:
    """The client's job on its server, as a function of the result callback."""
    http = servers.clients[client]
    if client == PARROT:
        return lambda on_result: parrot_map_reduce(http, doc, on_result=on_result)
    model = servers.baseline.engines[0].model_name
    return lambda on_result: baseline_map_reduce(http, doc, model=model, on_result=on_result)


async def run_once(servers: Servers, client: str, doc: MapReduceDoc) -> Run:
    """One timed job of ``client`` (the session's delete, after the result, not timed nor counted)."""
    served = servers.of(client)
    requests_before = Counter(served.request_counts)
    engine_before = engine_counters(served)
    done: list[float] = []
    start = time.perf_counter()
    output = await runner(servers, client, doc)(lambda _: done.append(time.perf_counter()))
    made = Counter(served.request_counts) - requests_before
    after = engine_counters(served)
    return Run(
        seconds=done[0] - start,
        output=output,
        requests=sum(n for (method, _), n in made.items() if method != "DELETE"),
        engine={k: after[k] - engine_before[k] for k in ENGINE_COUNTERS},
    )


@dataclass
class MapReduceClientResult(ClientResult):
    """A client in one setting; also the engine's work per run."""

    engine: list[dict[str, int]] = field(default_factory=list)

    def engine_median(self, name: str) -> float:
        values = [e[name] for e in self.engine]
        return statistics.median(values) if values else float("nan")

    @property
    def mean_decode_batch(self) -> float:
        """Decode tokens per engine step (all steps, prefill ones included): a lower bound on how many
        requests decoded at once."""
        steps = self.engine_median("steps")
        return safe_ratio(self.engine_median("decode_tokens_computed"), steps)


@dataclass
class SettingResult:
    """Both clients in one setting (with or without the simulated network delay)."""

    delay: bool
    clients: dict[str, MapReduceClientResult]

    def speedup(self) -> float:
        """Baseline median latency over Parrot's."""
        return safe_ratio(self.clients[BASELINE].spread.median, self.clients[PARROT].spread.median)

    def speedup_range(self) -> tuple[float, float]:
        """The range of the per-repeat ratios (repeat i of the baseline over repeat i of Parrot)."""
        ratios = [
            safe_ratio(b, p)
            for b, p in zip(self.clients[BASELINE].seconds, self.clients[PARROT].seconds, strict=True)
        ]
        s = Spread.of(ratios)
        return s.lo, s.hi


async def verify(servers: Servers, doc: MapReduceDoc) -> str:
    """The final summary, identical for both clients (greedy); stops the run otherwise. Also the warm-up."""
    got = {client: (await run_once(servers, client, doc)).output for client in CLIENTS}
    if got[PARROT] != got[BASELINE]:
        raise SystemExit(f"outputs differ\n  parrot: {got[PARROT]!r}\n  baseline: {got[BASELINE]!r}")
    return got[PARROT]


async def measure_setting(
    servers: Servers, doc: MapReduceDoc, repeats: int, delay: bool, expected: str
) -> SettingResult:
    """``repeats`` jobs per client, interleaved (alternating which client goes first)."""
    servers.set_delay(delay)
    results = {name: MapReduceClientResult() for name in CLIENTS}
    try:
        for rep in range(repeats):
            for name in CLIENTS if rep % 2 == 0 else CLIENTS[::-1]:
                run = await run_once(servers, name, doc)
                if run.output != expected:
                    raise SystemExit(f"{name}: the output changed between runs (not deterministic?)")
                results[name].seconds.append(run.seconds)
                results[name].requests.append(run.requests)
                results[name].engine.append(run.engine)
            log(
                f"  {'delay' if delay else 'no delay'} repeat {rep + 1}: "
                + " | ".join(f"{n} {r.seconds[-1]:.3f}s" for n, r in results.items())
            )
    finally:
        servers.set_delay(False)
    return SettingResult(delay, results)


@dataclass
class Shape:
    """Token counts of the job as the engine sees them (prompt tokens with the tokenizer's BOS)."""

    map_prompt_tokens: list[int]
    reduce_prompt_tokens: int
    map_request_tokens: int  # largest map prompt + map_tokens
    reduce_request_tokens: int
    map_requests_under_cap: int


def job_shape(tokenizer: Any, doc: MapReduceDoc, summaries: Sequence[str], cap: int) -> Shape:
    maps = [len(tokenizer.encode(doc.map_prompt(c))) for c in doc.chunks]
    reduce = len(tokenizer.encode(doc.reduce_prompt(summaries)))
    map_request = max(maps) + doc.map_tokens
    return Shape(maps, reduce, map_request, reduce + doc.reduce_tokens, cap // map_request)


async def map_summaries(servers: Servers, doc: MapReduceDoc) -> list[str]:
    """The map stage's answers (untimed, from the baseline server), to size the reduce prompt."""
    http = servers.clients[BASELINE]

    async def complete(chunk: str) -> str:
        body = {"prompt": doc.map_prompt(chunk), **doc.sampling(doc.map_tokens)}
        r = await http.post("/v1/completions", json=body)
        r.raise_for_status()
        return str(r.json()["choices"][0]["text"])

    return list(await asyncio.gather(*(complete(c) for c in doc.chunks)))


# ----------------------------------------------------------------------------------------------- report
def results_table(settings: list[SettingResult]) -> str:
    """Median latency per job, spread, requests, the engine's work and the ratio, per setting and client."""
    rows = []
    for st in settings:
        lo, hi = st.speedup_range()
        for name in CLIENTS:
            c = st.clients[name]
            s = c.spread
            rows.append(
                [
                    "250 ms (0.2-0.3 s)" if st.delay else "none",
                    name,
                    f"{s.median:.3f} ±{s.rel_half_range:.0%}",
                    f"{s.lo:.3f}-{s.hi:.3f}",
                    str(c.requests[0]) if c.requests else "",
                    f"{c.engine_median('steps'):.0f}",
                    f"{c.engine_median('prefill_tokens_computed'):.0f}",
                    f"{c.mean_decode_batch:.1f}",
                    f"{st.speedup():.2f}x ({lo:.2f}-{hi:.2f})" if name == PARROT else "",
                ]
            )
    return markdown_table(
        [
            "network delay",
            "client",
            "latency s (median)",
            "range s",
            "requests/job",
            "engine steps",
            "prefill tokens",
            "decode tokens/step",
            "baseline / parrot",
        ],
        rows,
        [False, False, True, True, True, True, True, True, True],
    )


def print_report(
    cfg: BenchConfig,
    model: str,
    machine: dict[str, Any],
    shape: Shape,
    settings: list[SettingResult],
    total_s: float,
) -> None:
    print(
        f"## map_reduce — {model}, {machine['cpu_model']}, {machine['usable_cores']} cores, "
        f"torch {machine['torch']} ({machine['torch_threads']} threads), "
        f"load average {machine['load_average_1m']} at start\n"
    )
    print(
        f"{cfg.chunks} map calls over parts of {cfg.chunk_tokens} tokens (prompts "
        f"{min(shape.map_prompt_tokens)}-{max(shape.map_prompt_tokens)} tokens), {cfg.map_tokens} tokens "
        f"each, then one reduce call (prompt {shape.reduce_prompt_tokens} tokens) writing "
        f"{cfg.reduce_tokens} tokens; greedy, EOS ignored. Latency cap {cfg.latency_cap_tokens} running "
        "tokens (the baseline "
        f"engine's FIFO admission cap, the Parrot manager's latency cap): {shape.map_requests_under_cap} map "
        f"requests of {shape.map_request_tokens} tokens fit under it. End-to-end latency of one job, median "
        f"of {cfg.repeats} jobs per client after a warm-up, ± half the range; final summaries identical "
        "between the clients (checked). Requests/job: HTTP requests of one job (Parrot: session create + "
        "one batch; its delete, after the result, not counted). Engine columns: medians per job of engine "
        "steps and prefill tokens, and decode tokens per step (prefill steps included: a lower bound on the "
        "decode batch).\n"
    )
    print(results_table(settings) + "\n")
    print(f"paper anchor (Fig. 14, map-reduce summary, one A100): {PAPER_ANCHOR}x. total {total_s:.0f}s")


def json_payload(
    cfg: BenchConfig,
    model: str,
    machine: dict[str, Any],
    doc: MapReduceDoc,
    shape: Shape,
    settings: list[SettingResult],
    total_s: float,
) -> dict[str, Any]:
    """Every figure, the raw times, and what is needed to reproduce or judge them."""
    parrot_engine, baseline_engine = engine_configs(cfg)
    return {
        "benchmark": NAME,
        "config": asdict(cfg),
        "model": model,
        "engine_config": {
            PARROT: {k: str(v) for k, v in asdict(parrot_engine).items()},
            BASELINE: {k: str(v) for k, v in asdict(baseline_engine).items()},
        },
        "manager_config": {PARROT: {"latency_cap_tokens": cfg.latency_cap_tokens}},
        "templates": {"map": MAP_TEMPLATE, "reduce": doc.reduce_template},
        "shape": asdict(shape),
        "machine": machine,
        "load_average_1m_at_end": load_average(),
        "outputs_identical": True,
        "settings": [
            {
                "network_delay": st.delay,
                "delay_s": [cfg.delay_low_s, cfg.delay_high_s] if st.delay else None,
                "speedup": st.speedup(),
                "speedup_range": list(st.speedup_range()),
                "clients": {
                    name: {
                        **asdict(c),
                        "latency": c.spread.as_dict(),
                        "mean_decode_batch": c.mean_decode_batch,
                    }
                    for name, c in st.clients.items()
                },
            }
            for st in settings
        ],
        "paper_anchor": PAPER_ANCHOR,
        "total_s": total_s,
    }


def result_metrics(
    settings: list[SettingResult], sims: dict[int, SimResult], total_s: float
) -> dict[str, float | int]:
    """The RESULT line: the speedups first, then the medians (with delay, then without); NaN for a setting
    not measured (``--no-delay-only``), so the keys are always the same."""
    by_delay = {st.delay: st for st in settings}

    def speedup(delay: bool) -> float:
        return by_delay[delay].speedup() if delay in by_delay else math.nan

    def median(delay: bool, client: str) -> float:
        return by_delay[delay].clients[client].spread.median if delay in by_delay else math.nan

    return {
        "speedup": speedup(True),
        "speedup_nodelay": speedup(False),
        "parrot_s": median(True, PARROT),
        "baseline_s": median(True, BASELINE),
        "parrot_nodelay_s": median(False, PARROT),
        "baseline_nodelay_s": median(False, BASELINE),
        **{f"sim_speedup_out{n}": sim.speedup for n, sim in sims.items()},
        **{f"sim_parrot_out{n}_s": sim.parrot_s for n, sim in sims.items()},
        **{f"sim_baseline_out{n}_s": sim.baseline_s for n, sim in sims.items()},
        "total_s": total_s,
    }


# ----------------------------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_size_flags(parser, "8 map calls, 3 repeats (~1 min)")
    add_engine_flags(parser)
    parser.add_argument("--repeats", type=int, help="timed jobs per client and setting (median)")
    parser.add_argument("--chunks", type=int, help="map calls (document parts)")
    parser.add_argument("--chunk-tokens", type=int, help="document tokens per part")
    parser.add_argument("--map-tokens", type=int, help="summary tokens per map call")
    parser.add_argument("--reduce-tokens", type=int, help="tokens of the final summary")
    parser.add_argument("--latency-cap", type=int, help="latency cap in running tokens (both servers)")
    parser.add_argument(
        "--no-delay-only", action="store_true", help="measure without the network delay only (tests)"
    )
    parser.add_argument("--sim-chunks", type=int, help="map calls of the simulated GPU-scale job")
    return parser.parse_args(argv)


def build_config(args: argparse.Namespace) -> BenchConfig:
    return sized(
        args,
        FULL,
        QUICK,
        TINY,
        repeats=args.repeats,
        chunks=args.chunks,
        chunk_tokens=args.chunk_tokens,
        map_tokens=args.map_tokens,
        reduce_tokens=args.reduce_tokens,
        latency_cap_tokens=args.latency_cap,
    )


async def run_benchmark(
    servers: Servers, cfg: BenchConfig, delays: Sequence[bool]
) -> tuple[MapReduceDoc, Shape, list[SettingResult]]:
    """Build the job, check the cap admits it, verify outputs, then measure each setting."""
    tokenizer = servers.parrot.engines[0].tokenizer
    doc = make_doc(tokenizer, cfg.chunks, cfg.chunk_tokens, cfg.map_tokens, cfg.reduce_tokens)
    async with contextlib.AsyncExitStack() as stack:
        for name in CLIENTS:
            http = httpx.AsyncClient(base_url=servers.of(name).url, timeout=300)
            servers.clients[name] = await stack.enter_async_context(http)
        shape = job_shape(tokenizer, doc, await map_summaries(servers, doc), cfg.latency_cap_tokens)
        if shape.reduce_request_tokens > cfg.latency_cap_tokens or shape.map_requests_under_cap < 1:
            raise SystemExit(
                f"the latency cap ({cfg.latency_cap_tokens} tokens) must admit one map request "
                f"({shape.map_request_tokens}) and the reduce request ({shape.reduce_request_tokens}): "
                "raise --latency-cap or shrink the job"
            )
        log(f"verifying outputs and warming up ({cfg.chunks} map calls) ...")
        expected = await verify(servers, doc)
        settings = [await measure_setting(servers, doc, cfg.repeats, d, expected) for d in delays]
    return doc, shape, settings


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    cfg = build_config(args)

    set_threads(args)
    started = time.perf_counter()
    machine = machine_info()
    log(
        f"starting two servers ({args.model}): parrot, and the baseline capped at "
        f"{cfg.latency_cap_tokens} running tokens ..."
    )
    delays = (False,) if args.no_delay_only else (False, True)
    with serve(args.model, cfg) as servers:
        doc, shape, settings = asyncio.run(run_benchmark(servers, cfg, delays))
    default_chunks = 2 if args.tiny else 16 if args.quick else SimConfig.chunks
    sim_cfg = SimConfig(chunks=args.sim_chunks or default_chunks)
    sims: dict[int, SimResult] = {}
    for out in SIM_OUTPUT_TOKENS:
        log(f"simulating the GPU-scale job ({sim_cfg.chunks} parts, {out}-token summaries) ...")
        sims[out] = simulate(replace(sim_cfg, map_tokens=out))
    total_s = time.perf_counter() - started
    print_report(cfg, args.model, machine, shape, settings, total_s)
    print(
        f"\nsimulator ({sim_cfg.profile}, 1 engine, {sim_cfg.chunks} parts x {sim_cfg.chunk_tokens} "
        f"tokens, latency cap {sim_cfg.latency_cap_tokens}; paper {PAPER_ANCHOR}x):"
    )
    for out, sim in sims.items():
        print(
            f"  {out}-token summaries: parrot {sim.parrot_s:.2f} s ({sim.parrot_steps} steps), baseline "
            f"{sim.baseline_s:.2f} s ({sim.baseline_steps} steps): {sim.speedup:.2f}x"
        )
    if args.json:
        payload = json_payload(cfg, args.model, machine, doc, shape, settings, total_s)
        payload["simulator"] = {
            "config": asdict(sim_cfg),
            "by_map_tokens": {out: {**asdict(sim), "speedup": sim.speedup} for out, sim in sims.items()},
        }
        write_json(args.json, payload)
    print(result_line(NAME, result_metrics(settings, sims, total_s)))


def plot(payload: dict[str, Any], path: Path) -> None:
    """Fig. 14 from a results payload: job latency per client and setting on the real engine (left), and
    the simulated GPU-scale job per summary length (right)."""
    plt = pyplot()
    fig, (real, sim) = plt.subplots(1, 2, figsize=(9, 3.4))
    settings = payload["settings"]
    labels = ["with delay" if s["network_delay"] else "no delay" for s in settings]
    for i, client in enumerate(CLIENTS):
        medians = [s["clients"][client]["latency"]["median"] for s in settings]
        real.bar([x + 0.4 * i for x in range(len(settings))], medians, width=0.4, label=client)
    real.set_xticks([x + 0.2 for x in range(len(settings))], labels)
    real.set_ylabel("job latency (s, CPU)")
    real.set_title("real engine (tiny model)", fontsize=9)
    real.legend(fontsize=8)
    by_out = payload.get("simulator", {}).get("by_map_tokens", {})
    outs = sorted(by_out, key=int)
    for i, key in enumerate(("parrot_s", "baseline_s")):
        sim.bar(
            [x + 0.4 * i for x in range(len(outs))],
            [by_out[o][key] for o in outs],
            width=0.4,
            label=key.removesuffix("_s"),
        )
    sim.set_xticks([x + 0.2 for x in range(len(outs))], [f"{o}-token summaries" for o in outs])
    sim.set_ylabel("job latency (simulated s)")
    sim.set_title("simulator (GPU profile)", fontsize=9)
    sim.legend(fontsize=8)
    save(fig, path)


if __name__ == "__main__":
    main()
