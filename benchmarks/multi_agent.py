"""Multi-agent programming (Fig. 18 of the Parrot paper): latency and KV memory vs number of files, one run.

The application (`benchmarks.workloads.multi_agent`): a MetaGPT-like team writes a package of ``files``
files — an architect, then ``rounds`` rounds of parallel coders, an integrator, parallel reviewers,
parallel revisers and a merger; ``1 + rounds * (3 * files + 2)`` LLM calls. Every prompt starts with the
shared message pool (a long project brief + every message so far), which is the prompt + output of an
earlier call, so Parrot forks it instead of prefilling it again. Greedy, EOS ignored: every call writes
exactly its token budget. Four clients, each on its own server (one engine each, the same `EngineConfig`,
the same engine code), measured in one run:

* **parrot** — the `parrot` frontend: every call of the job queued as a semantic call in one session, then
  one ``aget(criteria=P.LATENCY)`` of the final output (the last changelog) sends the whole DAG in one
  batch request. Objective deduction puts each parallel stage in a task group (placed together at the
  engine's full capacity); the manager's latency cap (``latency_cap_tokens``) binds latency-bound steps
  only (here: the final merger).
* **parrot, no sharing** — the same client and DAG on a manager with ``ManagerConfig(prefix_sharing=False)``:
  no shared constant-prefix contexts, no forks from cached contexts, every step fills its whole prompt.
* **parrot, no deduction** — the same client and DAG (sharing on) on a manager that holds every step to the
  latency cap (``ManagerConfig(engine_capacity_tokens=latency_cap_tokens)``), i.e. every request treated as
  latency-critical, as a service that cannot deduce objectives must. Why not simply omit the criteria: on
  one engine running one app, a plain ``get`` makes every step's objective "none", which the scheduler
  treats as throughput work capped by the engine's capacity — the very same batches as the task groups
  (it differs only for the final merger, which runs alone anyway). What deduction buys over a
  request-level service is permission to exceed the latency cap for task groups; this ablation takes it
  away and keeps the rest (server-side DAG, no client round trips, sharing).
* **baseline** — what a LangChain app does against an OpenAI-style service: the client renders each prompt
  itself (`benchmarks.common.render_template`), sends the calls of one stage as concurrent
  ``POST /v1/completions`` (``asyncio.gather``), waits for all of them, renders the next stage: one client
  round trip per dependent stage (``1 + 5 * rounds`` stages). The OpenAI path shares
  nothing (`server.openai_api`), and the baseline's engine admits requests FIFO under the running-token cap
  ``latency_cap_tokens`` (`EngineConfig.max_running_tokens`): the paper's latency-centric baseline.

Measurements, per number of files (a fresh set of servers for each, so nothing is cached at the start):

* **KV memory**: the peak number of KV blocks in use on the client's engine during its first job on the
  fresh server, counted exactly (the engine's high-water mark `EngineStats.blocks_peak`, restarted before
  the job — not sampled). Parrot keeps finished contexts cached for reuse (up to
  ``ManagerConfig.max_cached_prefixes``), and they are part of its peak. That first job of each client is
  also the check: all four clients' outputs of every call must be identical (greedy on all sides), else
  the run stops. It is untimed (the warm-up).
* **Latency**: end-to-end latency of one job, from the client's first request to the final output in its
  hands (Parrot: session creation included, the session's ``DELETE`` after the result not), median over
  ``--repeats`` jobs per client, clients interleaved (rotating which goes first), ± half the range. Two
  settings: without network delay, and with the simulated client network delay of ``U(0.2, 0.3)`` s per
  HTTP request (`server.netdelay`, the paper's 200-300 ms, switched on at run time on every server).
  Per client the engine's work per job (prefill tokens, steps) is recorded too.

Ratios: baseline / parrot latency (the paper's anchor: up to 11.7x at 16 files, one A100, LLaMA 13B),
no-sharing / parrot (paper: 2.35x from sharing), no-deduction / parrot, and peak-memory ratios
baseline / parrot and no-sharing / parrot. On a CPU with the tiny model, prefill is cheap next to the
per-step overhead of decoding, so sharing saves mostly memory and prefill time, not decode time (the
paper's shared-prefix kernel saving is a GPU effect); and a CPU decode step's cost grows with the batch,
so the larger batches that deduction allows pay far less than on a GPU — on 2 shared CPU cores the
no-deduction ablation measured 0.6x-1.1x of Parrot's latency (it can be faster), and Parrot's peak KV
includes the finished contexts it keeps cached, so with few files it can exceed the baseline's.

**At GPU scale, on the simulator** (`server.sim`, `SimConfig`): the same four client functions and the same
DAG drive the real manager and app over one simulated engine per client with the ``a100-llama7b`` latency
profile (given as data: derived from an A100's datasheet roofline for LLaMA-7B, not measured; its 64k-token
KV cache), on virtual time, with the ``U(0.2, 0.3)`` s network delay per request — the paper's setting,
where a larger batch costs little. Sizes: 4, 8 and 16 files (``--sim-files``; ``--quick``: 16 only), the
paper's 3 review rounds, longer outputs than on the CPU (design 128, code 48, review 24 tokens); the
pool of 3 rounds at 16 files makes the last prompts ~7,900 tokens, so the latency cap is 8,192 running
tokens (the paper's 4,096 admitted its longest request; this one does too). The same configs as on the
CPU: the baseline's engine admits FIFO under the cap and its OpenAI route caches nothing, no sharing and
no deduction as above. Deterministic, so one job per client on a fresh server (measured from the first
request to the final output in the client's hands); every call's output is checked against the
baseline's. Per client the engine's work (busy seconds, steps, prefill tokens, evictions, exact KV peak).

    python -m benchmarks.multi_agent [--quick | --tiny] [--json PATH] [--files 2,4,8] [--rounds N] ...
    (or python benchmarks/multi_agent.py ...)

The last line is ``RESULT multi_agent speedup=... speedup_nodelay=... speedup_vs_nosharing=...
speedup_vs_nodeduction=... mem_ratio=... mem_ratio_nosharing=... parrot_s=... baseline_s=... files=...
speedup_sim=... speedup_sim_no_sharing=... speedup_sim_no_deduction=... parrot_sim_s=... baseline_sim_s=...
files_sim=... total_s=...`` (at the largest number of files; ``speedup*`` with the network delay unless
noted; ``*_sim``: on the simulator, this client's / Parrot's simulated latency, at its largest number of
files).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import statistics
import sys
import time
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
    int_list,
    load_average,
    log,
    machine_info,
    markdown_table,
    result_line,
    safe_ratio,
    set_threads,
    sized,
    write_json,
)
from benchmarks.harness.systems import ENGINE_COUNTERS
from benchmarks.plotting import pyplot, save
from benchmarks.workloads.multi_agent import Budgets, Workflow, make_workflow, project_brief, stage_roles
from server.engine import EngineConfig
from server.launcher import LaunchedServer, launch
from server.serve.manager import ManagerConfig

NAME = "multi_agent"
PARROT = "parrot"
NO_SHARING = "parrot, no sharing"
NO_DEDUCTION = "parrot, no deduction"
BASELINE = "baseline"
CLIENTS = (PARROT, NO_SHARING, NO_DEDUCTION, BASELINE)
PAPER_ANCHOR = {
    "speedup_vs_baseline_max": 11.7,  # Fig. 18a, 16 files, latency-centric baseline
    "speedup_vs_throughput_baseline_max": 2.45,
    "speedup_from_sharing": 2.35,
    "note": "Fig. 18b: Parrot without sharing hits the GPU memory ceiling",
}

OnResult = Callable[[str], None]


# ----------------------------------------------------------------------------------------------- config
@dataclass(frozen=True)
class SimConfig:
    """The GPU-scale job on the simulator (see the module docstring)."""

    files: tuple[int, ...] = (4, 8, 16)  # the sweep; the RESULT line's ``*_sim`` figures are at the largest
    rounds: int = 3  # the paper's three review rounds
    brief_tokens: int = 256
    design_tokens: int = 128
    code_tokens: int = 48
    notes_tokens: int = 16
    review_tokens: int = 24
    changelog_tokens: int = 16
    # The latency cap in running tokens, as on the CPU (the baseline engine's FIFO cap, the Parrot managers'
    # cap for latency-bound steps, the no-deduction manager's cap for every step). The paper's 4,096 admits
    # its longest request (LLaMA's 4k window); here the pool holds every message of 3 rounds, and at 16
    # files the last prompts reach ~7,900 tokens, so the cap is the next power of two: one late request at
    # a time, as 4,096 was for the paper's long prompts. (A decode step at 8k running tokens: ~15 ms on
    # the profile, far under the paper's 40 ms per token.)
    latency_cap_tokens: int = 8192
    max_num_batched_tokens: int = 4096  # tokens per engine step (a GPU engine's prefill chunk)
    max_num_seqs: int = 256
    profile: str = "a100-llama7b"  # KV cache: the profile's (64k tokens), the same for every client

    def budgets(self) -> Budgets:
        return Budgets(
            self.design_tokens, self.code_tokens, self.notes_tokens, self.review_tokens, self.changelog_tokens
        )


@dataclass(frozen=True)
class BenchConfig:
    """What one run measures."""

    files: tuple[int, ...] = (2, 4, 8)  # the sweep
    rounds: int = 3
    brief_tokens: int = 256  # the project brief at the head of every prompt
    design_tokens: int = 32
    code_tokens: int = 32
    notes_tokens: int = 8
    review_tokens: int = 12
    changelog_tokens: int = 8
    # The latency cap in running tokens (prompt + max_tokens of what runs): the baseline engine's FIFO
    # admission cap, the Parrot managers' cap for latency-bound steps, and the no-deduction manager's cap
    # for every step. It admits the largest request (checked), and only one or two of the long late-round
    # prompts at once at 8 files, as the paper's 4096-token cap does for LLaMA-13B's long prompts.
    latency_cap_tokens: int = 4096
    num_kv_blocks: int = 2048  # per engine, 16-token blocks: room for a whole stage of 8 files at once
    repeats: int = 3
    delay_low_s: float = 0.2
    delay_high_s: float = 0.3
    seed: int = 0
    sim: SimConfig = SimConfig()  # the GPU-scale job on the simulator (with the network delay)

    def budgets(self) -> Budgets:
        return Budgets(
            self.design_tokens, self.code_tokens, self.notes_tokens, self.review_tokens, self.changelog_tokens
        )


FULL = BenchConfig()
QUICK = BenchConfig(
    files=(2, 4),
    rounds=1,
    brief_tokens=128,
    design_tokens=16,
    code_tokens=16,
    review_tokens=8,
    latency_cap_tokens=1024,
    num_kv_blocks=1024,
    repeats=2,
    sim=SimConfig(files=(16,)),  # the headline point only (~15 s of wall time)
)
TINY = BenchConfig(
    files=(2,),
    rounds=1,
    brief_tokens=32,
    design_tokens=4,
    code_tokens=4,
    notes_tokens=2,
    review_tokens=2,
    changelog_tokens=2,
    latency_cap_tokens=512,
    num_kv_blocks=256,
    repeats=1,
    sim=SimConfig(
        files=(2,),
        rounds=1,
        brief_tokens=32,
        design_tokens=4,
        code_tokens=4,
        notes_tokens=2,
        review_tokens=2,
        changelog_tokens=2,
        latency_cap_tokens=512,
    ),
)


# ----------------------------------------------------------------------------------------------- clients
async def parrot_multi_agent(
    client: httpx.AsyncClient,
    workflow: Workflow,
    *,
    criteria: Criteria = "latency",
    timeout: float = 600.0,
    on_result: OnResult | None = None,
    all_outputs: bool = False,
) -> dict[str, str]:
    """The whole job through the `parrot` frontend on the server at ``client.base_url``.

    One session: every call is queued (inputs are earlier calls' output variables), and one ``aget`` of the
    final output with ``criteria`` sends the queue with the get in one batch request. ``on_result`` gets
    the final output as soon as it is in hand (before anything else), for timing. Returns the final output
    by name, and with ``all_outputs`` every call's output (fetched after ``on_result``).
    """
    fns = {
        c.output: P.SemanticFunction.from_template(
            c.template, name=c.output, sampling=P.SamplingConfig(**workflow.sampling(c))
        )
        for c in workflow.calls
    }
    async with P.Session(str(client.base_url), client=client, timeout=timeout):
        made: dict[str, P.Variable] = {}
        for c in workflow.calls:
            out = fns[c.output](**{name: made[name] for name in c.inputs})
            assert isinstance(out, P.Variable)
            made[c.output] = out
        final = await made[workflow.final].aget(criteria=criteria)
        if on_result is not None:
            on_result(final)
        values = {workflow.final: final}
        if all_outputs:
            values.update({name: await var.aget() for name, var in made.items()})
    return values


async def baseline_multi_agent(
    client: httpx.AsyncClient,
    workflow: Workflow,
    *,
    model: str | None = None,
    on_result: OnResult | None = None,
) -> dict[str, str]:
    """The job as a request-centric client runs it: each stage's prompts rendered client-side from the
    answers so far and sent as concurrent ``/v1/completions``; the next stage after all answers are in.
    Returns every call's output by name."""

    async def complete(output: str, values: dict[str, str]) -> str:
        call = workflow.call(output)
        body: dict[str, Any] = {"prompt": workflow.prompt(output, values), **workflow.sampling(call)}
        if model is not None:
            body["model"] = model
        response = await client.post("/v1/completions", json=body)
        response.raise_for_status()
        return str(response.json()["choices"][0]["text"])

    values: dict[str, str] = {}
    for stage in workflow.stages:
        answers = await asyncio.gather(*(complete(out, values) for out in stage))
        values.update(zip(stage, answers, strict=True))
    if on_result is not None:
        on_result(values[workflow.final])
    return values


# ----------------------------------------------------------------------------------------------- memory
# ----------------------------------------------------------------------------------------------- servers
@dataclass
class Servers:
    """One server per client (one engine each) and their HTTP clients with request counters."""

    by_client: dict[str, LaunchedServer]
    clients: dict[str, httpx.AsyncClient] = field(default_factory=dict)

    def set_delay(self, enabled: bool) -> None:
        for served in self.by_client.values():
            assert served.network_delay is not None
            served.network_delay.enabled = enabled


def server_configs(cfg: BenchConfig) -> dict[str, tuple[EngineConfig, ManagerConfig]]:
    """Each client's engine and manager config on the CPU (`client_configs`)."""
    return client_configs(EngineConfig(num_kv_blocks=cfg.num_kv_blocks), cfg.latency_cap_tokens)


def client_configs(engine: EngineConfig, cap: int) -> dict[str, tuple[EngineConfig, ManagerConfig]]:
    """Each client's engine and manager config around one ``engine`` config and latency ``cap``: the same
    for all but the baseline's FIFO cap (the engine's), sharing (no sharing) and capacity (no deduction)."""
    # The baseline's OpenAI route caches nothing (the paper's request-centric service); Parrot's clients do
    # not use that route, so one manager config serves all.
    manager = ManagerConfig(latency_cap_tokens=cap, openai_prefix_cache=False)
    return {
        PARROT: (engine, manager),
        NO_SHARING: (engine, replace(manager, prefix_sharing=False)),
        NO_DEDUCTION: (engine, replace(manager, engine_capacity_tokens=cap)),
        BASELINE: (replace(engine, max_running_tokens=cap), manager),
    }


@contextlib.contextmanager
def serve(model: str, cfg: BenchConfig) -> Iterator[Servers]:
    """The four servers, their delay middleware switched off."""
    with contextlib.ExitStack() as stack:
        by_client = {
            name: stack.enter_context(
                launch(
                    model,
                    engine_config=engine,
                    manager_config=manager,
                    startup_timeout=120,
                    network_delay=(cfg.delay_low_s, cfg.delay_high_s),
                    network_delay_seed=cfg.seed,
                )
            )
            for name, (engine, manager) in server_configs(cfg).items()
        }
        servers = Servers(by_client)
        servers.set_delay(False)
        yield servers


# ----------------------------------------------------------------------------------------------- measuring
@dataclass
class Run:
    """One job: latency to the final output, the outputs, HTTP requests made and the engine's work."""

    seconds: float
    outputs: dict[str, str]
    requests: int
    engine: dict[str, int]


def runner(
    servers: Servers, client: str, workflow: Workflow, all_outputs: bool
) -> Callable[[OnResult], Awaitable[dict[str, str]]]:
    """The client's job on its server, as a function of the result callback."""
    http = servers.clients[client]
    if client == BASELINE:
        model = servers.by_client[client].engines[0].model_name
        return lambda on_result: baseline_multi_agent(http, workflow, model=model, on_result=on_result)
    return lambda on_result: parrot_multi_agent(http, workflow, on_result=on_result, all_outputs=all_outputs)


def _counters(served: LaunchedServer) -> dict[str, int]:
    stats = served.engines[0].stats()
    return {name: int(getattr(stats, name)) for name in ENGINE_COUNTERS}


async def run_once(servers: Servers, client: str, workflow: Workflow, all_outputs: bool = False) -> Run:
    """One timed job of ``client``: requests counted up to the result (Parrot's later gets and delete not)."""
    served = servers.by_client[client]
    counter = servers.clients[client].event_hooks["request"][0]
    assert isinstance(counter, RequestCounter)
    engine_before = _counters(served)
    done: list[tuple[float, int]] = []
    requests_before = counter.count
    start = time.perf_counter()
    outputs = await runner(servers, client, workflow, all_outputs)(
        lambda _: done.append((time.perf_counter(), counter.count))
    )
    after = _counters(served)
    return Run(
        seconds=done[0][0] - start,
        outputs=outputs,
        requests=done[0][1] - requests_before,
        engine={k: after[k] - engine_before[k] for k in ENGINE_COUNTERS},
    )


class RequestCounter:
    """An httpx request hook counting the requests a client sends."""

    def __init__(self) -> None:
        self.count = 0

    async def __call__(self, request: httpx.Request) -> None:
        self.count += 1


@dataclass
class ClientMeasure(ClientResult):
    """A client in one delay setting; also the engine's work per job."""

    engine: list[dict[str, int]] = field(default_factory=list)

    def engine_median(self, name: str) -> float:
        values = [e[name] for e in self.engine]
        return statistics.median(values) if values else math.nan


@dataclass
class DelaySetting:
    """Every client in one delay setting."""

    delay: bool
    clients: dict[str, ClientMeasure]

    def speedup(self, slower: str, faster: str = PARROT) -> float:
        """``slower``'s median latency over ``faster``'s."""
        return safe_ratio(self.clients[slower].spread.median, self.clients[faster].spread.median)

    def speedup_range(self, slower: str, faster: str = PARROT) -> tuple[float, float]:
        """The range of the per-repeat ratios (repeat i of ``slower`` over repeat i of ``faster``)."""
        pairs = zip(self.clients[slower].seconds, self.clients[faster].seconds, strict=True)
        s = Spread.of(safe_ratio(a, b) for a, b in pairs)
        return s.lo, s.hi


@dataclass
class Cold:
    """A client's first job on its fresh server: exact KV peak and the engine's work (untimed)."""

    peak_blocks: int
    engine: dict[str, int]


@dataclass
class FilesResult:
    """Everything measured for one number of files."""

    files: int
    calls: int
    prompt_tokens: dict[str, list[int]]  # role -> prompt tokens of its calls (BOS included)
    longest_request: int
    cold: dict[str, Cold]
    settings: list[DelaySetting]

    def setting(self, delay: bool) -> DelaySetting | None:
        return next((s for s in self.settings if s.delay == delay), None)

    def mem_ratio(self, client: str) -> float:
        return safe_ratio(self.cold[client].peak_blocks, self.cold[PARROT].peak_blocks)


async def verify_cold(servers: Servers, workflow: Workflow) -> tuple[dict[str, str], dict[str, Cold]]:
    """Each client's first job, one at a time: exact KV peak, and every output identical to the baseline's
    (greedy); stops the run otherwise. Also the warm-up."""
    cold: dict[str, Cold] = {}
    outputs: dict[str, dict[str, str]] = {}
    for client in (BASELINE, PARROT, NO_SHARING, NO_DEDUCTION):
        engine = servers.by_client[client].engines[0]
        engine.reset_peak_blocks()
        run = await run_once(servers, client, workflow, all_outputs=True)
        cold[client] = Cold(engine.stats().blocks_peak, run.engine)
        outputs[client] = run.outputs
        if client != BASELINE:
            diff = [k for k, v in outputs[BASELINE].items() if run.outputs.get(k) != v]
            if diff:
                k = diff[0]
                raise SystemExit(
                    f"outputs differ ({client} vs baseline) at {k} and {len(diff) - 1} more\n"
                    f"  {client}: {run.outputs.get(k)!r}\n  baseline: {outputs[BASELINE][k]!r}"
                )
    return outputs[BASELINE], cold


async def measure_setting(
    servers: Servers, workflow: Workflow, repeats: int, delay: bool, expected: str
) -> DelaySetting:
    """``repeats`` jobs per client, interleaved, rotating which client goes first."""
    servers.set_delay(delay)
    results = {name: ClientMeasure() for name in CLIENTS}
    try:
        for rep in range(repeats):
            order = CLIENTS[rep % len(CLIENTS) :] + CLIENTS[: rep % len(CLIENTS)]
            for name in order:
                run = await run_once(servers, name, workflow)
                if run.outputs[workflow.final] != expected:
                    raise SystemExit(f"{name}: the final output changed between runs (not deterministic?)")
                results[name].seconds.append(run.seconds)
                results[name].requests.append(run.requests)
                results[name].engine.append(run.engine)
            log(
                f"  {'delay' if delay else 'no delay'} repeat {rep + 1}: "
                + " | ".join(f"{n} {r.seconds[-1]:.2f}s" for n, r in results.items())
            )
    finally:
        servers.set_delay(False)
    return DelaySetting(delay, results)


async def measure_files(
    servers: Servers, cfg: BenchConfig, files: int, delays: Sequence[bool]
) -> tuple[Workflow, FilesResult]:
    """Build the job for ``files`` files, check it fits, verify outputs and memory, then time it."""
    engine = servers.by_client[PARROT].engines[0]
    tokenizer = engine.tokenizer
    brief = project_brief(tokenizer, cfg.brief_tokens, cfg.seed)
    workflow = make_workflow(brief, files, cfg.rounds, cfg.seed, cfg.budgets())
    async with contextlib.AsyncExitStack() as stack:
        for name, served in servers.by_client.items():
            http = httpx.AsyncClient(
                base_url=served.url, timeout=600, event_hooks={"request": [RequestCounter()]}
            )
            servers.clients[name] = await stack.enter_async_context(http)
        log(f"{files} files: {len(workflow.calls)} calls; cold jobs (memory, output check) ...")
        # The baseline goes first: its outputs size every prompt, checked against the window and the cap
        # before any Parrot job (an oversized step would fail there, not wait).
        values, cold = await verify_cold(servers, workflow)
        longest = workflow.check_window(tokenizer, values, engine.max_model_len)
        if longest > cfg.latency_cap_tokens:
            raise SystemExit(
                f"the latency cap ({cfg.latency_cap_tokens} tokens) must admit the longest request "
                f"({longest}): raise --latency-cap or shrink the job"
            )
        prompts: dict[str, list[int]] = {}
        for c in workflow.calls:
            prompts.setdefault(c.role, []).append(len(tokenizer.encode(workflow.prompt(c.output, values))))
        settings = [
            await measure_setting(servers, workflow, cfg.repeats, d, values[workflow.final]) for d in delays
        ]
        servers.clients.clear()
    return workflow, FilesResult(files, len(workflow.calls), prompts, longest, cold, settings)


# ----------------------------------------------------------------------------------------------- simulator
@dataclass
class SimClient:
    """One client's job on a fresh simulated server: simulated seconds to the final output, the HTTP
    requests made until then, and the engine's work (the whole job; Parrot's later gets add none)."""

    seconds: float
    requests: int
    busy_s: float  # simulated seconds the engine spent in steps
    steps: int
    prefill_tokens: int
    decode_tokens: int
    peak_blocks: int
    preemptions: int
    evictions: int


@dataclass
class SimFilesResult:
    """Every client on the simulator for one number of files."""

    files: int
    calls: int
    longest_request: int
    clients: dict[str, SimClient]

    def speedup(self, slower: str, faster: str = PARROT) -> float:
        return safe_ratio(self.clients[slower].seconds, self.clients[faster].seconds)


def sim_server_configs(sim: SimConfig) -> dict[str, tuple[EngineConfig, ManagerConfig]]:
    """Each client's engine and manager config on the simulator (`client_configs`; the KV cache is the
    profile's)."""
    engine = EngineConfig(
        device="cpu", max_num_batched_tokens=sim.max_num_batched_tokens, max_num_seqs=sim.max_num_seqs
    )
    return client_configs(engine, sim.latency_cap_tokens)


def sim_workflow(cfg: BenchConfig, files: int) -> Workflow:
    """The simulator's job for ``files`` files (its brief in the simulated engine's tokenizer)."""
    from server.sim import tiny_tokenizer

    sim = cfg.sim
    brief = project_brief(tiny_tokenizer(), sim.brief_tokens, cfg.seed)
    return make_workflow(brief, files, sim.rounds, cfg.seed, sim.budgets())


def simulate_files(cfg: BenchConfig, files: int) -> SimFilesResult:
    """Each client's job once on a fresh simulated server (one engine, the GPU profile, virtual time, the
    network delay on: deterministic, so one run each); every call's output checked against the baseline's."""
    from server.sim import load_profile, run, sim_cluster, tiny_tokenizer

    sim = cfg.sim
    latency = load_profile(sim.profile)
    workflow = sim_workflow(cfg, files)
    configs = sim_server_configs(sim)

    async def one(client: str) -> tuple[dict[str, str], SimClient]:
        engine_config, manager_config = configs[client]
        async with sim_cluster(
            1,
            latency,
            engine_config=engine_config,
            manager_config=manager_config,
            network_delay=(cfg.delay_low_s, cfg.delay_high_s),
            network_delay_seed=cfg.seed,
        ) as cluster:
            counter = RequestCounter()
            cluster.client.event_hooks = {"request": [counter]}
            done: list[tuple[float, int]] = []

            def on_result(_: str) -> None:
                done.append((cluster.now(), counter.count))

            start = cluster.now()
            if client == BASELINE:
                outputs = await baseline_multi_agent(cluster.client, workflow, on_result=on_result)
            else:
                outputs = await parrot_multi_agent(
                    cluster.client, workflow, on_result=on_result, all_outputs=True
                )
            engine = cluster.engines[0]
            st = engine.stats()
            return outputs, SimClient(
                seconds=done[0][0] - start,
                requests=done[0][1],
                busy_s=engine.busy_seconds,
                steps=st.steps,
                prefill_tokens=st.prefill_tokens_computed,
                decode_tokens=st.decode_tokens_computed,
                peak_blocks=st.blocks_peak,
                preemptions=st.preemptions,
                evictions=st.evictions,
            )

    log(f"simulator ({sim.profile}): {files} files, {len(workflow.calls)} calls ...")
    clients: dict[str, SimClient] = {}
    expected, clients[BASELINE] = run(one(BASELINE))
    # The baseline's outputs size every prompt: an oversized step would fail on Parrot's capped managers.
    longest = workflow.check_window(tiny_tokenizer(), expected, latency.max_model_len)
    if longest > sim.latency_cap_tokens:
        raise SystemExit(
            f"simulator: the latency cap ({sim.latency_cap_tokens} tokens) must admit the longest request "
            f"({longest}): shrink the simulated job"
        )
    for client in (PARROT, NO_SHARING, NO_DEDUCTION):
        outputs, clients[client] = run(one(client))
        diff = [k for k, v in expected.items() if outputs.get(k) != v]
        if diff:
            raise SystemExit(f"simulator: outputs differ ({client} vs baseline) at {diff[0]} and more")
    log(
        f"  {files} files: "
        + " | ".join(f"{n} {c.seconds:.2f}s" for n, c in clients.items())
        + " (simulated)"
    )
    return SimFilesResult(files, len(workflow.calls), longest, {name: clients[name] for name in CLIENTS})


# ----------------------------------------------------------------------------------------------- report
def delay_label(delay: bool) -> str:
    return "250 ms (0.2-0.3 s)" if delay else "none"


def results_table(results: Sequence[FilesResult]) -> str:
    """Per files, setting and client: median latency, spread, requests, engine work, ratio, KV peak."""
    rows = []
    for fr in results:
        for st in fr.settings:
            for name in CLIENTS:
                c = st.clients[name]
                s = c.spread
                lo, hi = st.speedup_range(name)
                rows.append(
                    [
                        str(fr.files),
                        delay_label(st.delay),
                        name,
                        f"{s.median:.2f} ±{s.rel_half_range:.0%}",
                        str(c.requests[0]) if c.requests else "",
                        f"{c.engine_median('prefill_tokens_computed'):,.0f}",
                        f"{c.engine_median('steps'):,.0f}",
                        "" if name == PARROT else f"{st.speedup(name):.2f}x ({lo:.2f}-{hi:.2f})",
                        f"{fr.cold[name].peak_blocks:,}",
                    ]
                )
    return markdown_table(
        [
            "files",
            "network delay",
            "client",
            "latency s (median)",
            "requests/job",
            "prefill tokens",
            "engine steps",
            "this / parrot",
            "peak KV blocks",
        ],
        rows,
        [True, False, False, True, True, True, True, True, True],
    )


def sim_table(sims: Sequence[SimFilesResult]) -> str:
    """Per files and client on the simulator: simulated latency, requests, engine work, ratio, KV peak."""
    rows = [
        [
            str(sr.files),
            name,
            f"{c.seconds:.2f}",
            str(c.requests),
            f"{c.busy_s:.2f}",
            f"{c.steps:,}",
            f"{c.prefill_tokens:,}",
            f"{c.evictions}",
            "" if name == PARROT else f"{sr.speedup(name):.2f}x",
            f"{c.peak_blocks:,}",
        ]
        for sr in sims
        for name, c in sr.clients.items()
    ]
    return markdown_table(
        [
            "files",
            "client",
            "latency s (simulated)",
            "requests",
            "engine busy s",
            "engine steps",
            "prefill tokens",
            "evictions",
            "this / parrot",
            "peak KV blocks",
        ],
        rows,
        [True, False, True, True, True, True, True, True, True, True],
    )


def print_report(
    cfg: BenchConfig,
    model: str,
    machine: dict[str, Any],
    results: Sequence[FilesResult],
    sims: Sequence[SimFilesResult],
    total_s: float,
) -> None:
    print(
        f"## multi_agent — {model}, {machine['cpu_model']}, {machine['usable_cores']} cores, "
        f"torch {machine['torch']} ({machine['torch_threads']} threads), "
        f"load average {machine['load_average_1m']} at start\n"
    )
    shapes = "; ".join(
        f"{fr.files} files: {fr.calls} calls, prompts "
        f"{min(min(v) for v in fr.prompt_tokens.values())}-{fr.longest_request} tokens"
        for fr in results
    )
    print(
        f"MetaGPT-like job: architect, then {cfg.rounds} rounds of coders / integrator / reviewers / "
        f"revisers / merger; brief {cfg.brief_tokens} tokens, outputs design {cfg.design_tokens}, code "
        f"{cfg.code_tokens}, notes {cfg.notes_tokens}, review {cfg.review_tokens}, changelog "
        f"{cfg.changelog_tokens} tokens (greedy, EOS ignored). {shapes} (longest: prompt + max_tokens). "
        f"Latency cap {cfg.latency_cap_tokens} running tokens. Latency: median of {cfg.repeats} jobs per "
        "client after a warm-up, ± half the range; every call's output identical across the clients "
        "(checked). Peak KV blocks: exact, during each client's first job on a fresh server (16-token "
        "blocks). Prefill tokens / engine steps: medians per timed job.\n"
    )
    print(results_table(results) + "\n")
    if sims:
        sim = cfg.sim
        shapes = "; ".join(f"{sr.files} files: {sr.calls} calls, longest {sr.longest_request}" for sr in sims)
        print(
            f"Simulator (`server.sim`, profile {sim.profile}: derived from an A100's datasheet for "
            f"LLaMA-7B, not measured; virtual time, one engine per client, network delay "
            f"U({cfg.delay_low_s}, {cfg.delay_high_s}) s per request, one run each — deterministic): "
            f"{sim.rounds} rounds, brief {sim.brief_tokens} tokens, outputs design {sim.design_tokens}, "
            f"code {sim.code_tokens}, notes {sim.notes_tokens}, review {sim.review_tokens}, changelog "
            f"{sim.changelog_tokens}; latency cap {sim.latency_cap_tokens} running tokens. {shapes} "
            "(prompt + max_tokens). Every call's output identical across the clients (checked).\n"
        )
        print(sim_table(sims) + "\n")
    print(
        f"paper anchor (Fig. 18, one A100, LLaMA 13B): up to {PAPER_ANCHOR['speedup_vs_baseline_max']}x vs "
        f"the latency-centric baseline, {PAPER_ANCHOR['speedup_from_sharing']}x from sharing. "
        f"total {total_s:.0f}s"
    )


def json_payload(
    cfg: BenchConfig,
    model: str,
    machine: dict[str, Any],
    workflows: Sequence[Workflow],
    results: Sequence[FilesResult],
    sims: Sequence[SimFilesResult],
    total_s: float,
) -> dict[str, Any]:
    """Every figure, the raw times, and what is needed to reproduce or judge them."""
    return {
        "benchmark": NAME,
        "config": asdict(cfg),
        "model": model,
        "clients": list(CLIENTS),
        "engine_config": {
            name: {k: str(v) for k, v in asdict(engine).items()}
            for name, (engine, _) in server_configs(cfg).items()
        },
        "manager_config": {
            name: {k: str(v) for k, v in asdict(manager).items()}
            for name, (_, manager) in server_configs(cfg).items()
        },
        "machine": machine,
        "load_average_1m_at_end": load_average(),
        "outputs_identical": True,
        "by_files": [
            {
                "files": fr.files,
                "calls": fr.calls,
                "stages": [list(s) for s in stage_roles(wf)],
                "prompt_tokens": fr.prompt_tokens,
                "longest_request_tokens": fr.longest_request,
                "memory": {
                    name: {"peak_blocks": c.peak_blocks, "cold_engine": c.engine}
                    for name, c in fr.cold.items()
                },
                "mem_ratio_vs_parrot": {name: fr.mem_ratio(name) for name in CLIENTS},
                "settings": [
                    {
                        "network_delay": st.delay,
                        "delay_s": [cfg.delay_low_s, cfg.delay_high_s] if st.delay else None,
                        "clients": {
                            name: {
                                **asdict(c),
                                "latency": c.spread.as_dict(),
                                "speedup_vs_this": None if name == PARROT else st.speedup(name),
                                "speedup_range": None if name == PARROT else list(st.speedup_range(name)),
                            }
                            for name, c in st.clients.items()
                        },
                    }
                    for st in fr.settings
                ],
            }
            for wf, fr in zip(workflows, results, strict=True)
        ],
        "simulator": sim_payload(cfg.sim, sims),
        "paper_anchor": PAPER_ANCHOR,
        "total_s": total_s,
    }


def sim_payload(sim: SimConfig, sims: Sequence[SimFilesResult]) -> dict[str, Any]:
    """The simulator's figures (`json_payload`): its config, the profile, and per files every client."""
    from server.sim import load_profile

    return {
        "config": asdict(sim),
        "profile": asdict(load_profile(sim.profile)),
        "engine_config": {
            name: {k: str(v) for k, v in asdict(engine).items()}
            for name, (engine, _) in sim_server_configs(sim).items()
        },
        "by_files": [
            {
                "files": sr.files,
                "calls": sr.calls,
                "longest_request_tokens": sr.longest_request,
                "clients": {
                    name: {**asdict(c), "speedup_vs_this": None if name == PARROT else sr.speedup(name)}
                    for name, c in sr.clients.items()
                },
            }
            for sr in sims
        ],
    }


def result_metrics(
    results: Sequence[FilesResult], sims: Sequence[SimFilesResult], total_s: float
) -> dict[str, float | int]:
    """The RESULT line at the largest number of files: speedups (with delay, then without), memory ratios,
    medians; NaN for a setting not measured (``--no-delay-only``), so the keys are always the same. Then
    the simulator's, at its largest number of files (NaN without a simulator run)."""
    fr = max(results, key=lambda r: r.files)
    sr = max(sims, key=lambda r: r.files) if sims else None

    def sim_speedup(client: str) -> float:
        return sr.speedup(client) if sr is not None else math.nan

    def sim_seconds(client: str) -> float:
        return sr.clients[client].seconds if sr is not None else math.nan

    delay, nodelay = fr.setting(True), fr.setting(False)

    def speedup(st: DelaySetting | None, client: str) -> float:
        return st.speedup(client) if st is not None else math.nan

    def median(st: DelaySetting | None, client: str) -> float:
        return st.clients[client].spread.median if st is not None else math.nan

    return {
        "speedup": speedup(delay, BASELINE),
        "speedup_nodelay": speedup(nodelay, BASELINE),
        "speedup_vs_nosharing": speedup(delay, NO_SHARING),
        "speedup_vs_nodeduction": speedup(delay, NO_DEDUCTION),
        "speedup_vs_nosharing_nodelay": speedup(nodelay, NO_SHARING),
        "speedup_vs_nodeduction_nodelay": speedup(nodelay, NO_DEDUCTION),
        "mem_ratio": fr.mem_ratio(BASELINE),
        "mem_ratio_nosharing": fr.mem_ratio(NO_SHARING),
        "parrot_peak_blocks": fr.cold[PARROT].peak_blocks,
        "baseline_peak_blocks": fr.cold[BASELINE].peak_blocks,
        "parrot_s": median(delay, PARROT),
        "baseline_s": median(delay, BASELINE),
        "parrot_nodelay_s": median(nodelay, PARROT),
        "baseline_nodelay_s": median(nodelay, BASELINE),
        "files": fr.files,
        "speedup_sim": sim_speedup(BASELINE),
        "speedup_sim_no_sharing": sim_speedup(NO_SHARING),
        "speedup_sim_no_deduction": sim_speedup(NO_DEDUCTION),
        "parrot_sim_s": sim_seconds(PARROT),
        "baseline_sim_s": sim_seconds(BASELINE),
        "files_sim": sr.files if sr is not None else 0,
        "total_s": total_s,
    }


# ----------------------------------------------------------------------------------------------- plot
def plot(payload: dict[str, Any], path: Path) -> None:
    """Draw Fig. 18 from a `json_payload`: latency vs files per client (left; the delay setting where
    measured, else no delay), peak KV blocks vs files per client (middle), and where simulated, the
    simulated latency vs files per client (right), as a PNG at ``path``."""
    plt = pyplot()

    rows = sorted(payload["by_files"], key=lambda r: r["files"])
    files = [r["files"] for r in rows]
    clients = payload.get("clients", list(CLIENTS))
    sim_rows = sorted(payload.get("simulator", {}).get("by_files", []), key=lambda r: r["files"])
    fig, axes = plt.subplots(1, 3 if sim_rows else 2, figsize=(16 if sim_rows else 11, 4.2))
    left, right = axes[0], axes[1]
    delays = {s["network_delay"] for r in rows for s in r["settings"]}
    delay = True in delays
    for name in clients:
        med, lo, hi = [], [], []
        for r in rows:
            st = next(s for s in r["settings"] if s["network_delay"] == delay)
            lat = st["clients"][name]["latency"]
            med.append(lat["median"])
            lo.append(lat["median"] - lat["min"])
            hi.append(lat["max"] - lat["median"])
        left.errorbar(files, med, yerr=[lo, hi], marker="o", capsize=3, label=name)
        right.plot(files, [r["memory"][name]["peak_blocks"] for r in rows], marker="o", label=name)
    left.set(
        xlabel="files",
        ylabel="end-to-end latency (s)",
        title="latency" + (" (network delay 0.2-0.3 s)" if delay else " (no network delay)"),
        xticks=files,
    )
    right.set(xlabel="files", ylabel="peak KV blocks in use", title="KV memory (exact peak)", xticks=files)
    if sim_rows:
        sim_ax = axes[2]
        sim_files = [r["files"] for r in sim_rows]
        for name in clients:
            sim_ax.plot(sim_files, [r["clients"][name]["seconds"] for r in sim_rows], marker="o", label=name)
        profile = payload["simulator"].get("config", {}).get("profile", "GPU profile")
        sim_ax.set(
            xlabel="files",
            ylabel="end-to-end latency (simulated s)",
            title=f"simulator ({profile}, network delay)",
            xticks=sim_files,
        )
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.set_ylim(bottom=0)
    left.legend(fontsize=8)
    fig.suptitle(f"multi-agent programming ({payload.get('model', '')})")
    save(fig, path)


# ----------------------------------------------------------------------------------------------- main
def parse_files(text: str) -> tuple[int, ...]:
    """``"2,4,8"`` -> (2, 4, 8): at least one file count."""
    values = int_list(text)
    if not values:
        raise argparse.ArgumentTypeError(f"expected at least one number of files, got {text!r}")
    return values


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_size_flags(parser, "2 and 4 files, 1 round, short outputs, 2 repeats (~1 min)")
    add_engine_flags(parser)
    parser.add_argument("--repeats", type=int, help="timed jobs per client and setting (median)")
    parser.add_argument("--files", type=parse_files, help="numbers of files to sweep, e.g. 2,4,8")
    parser.add_argument("--rounds", type=int, help="review rounds (paper: 3)")
    parser.add_argument("--brief-tokens", type=int, help="tokens of the project brief")
    parser.add_argument("--latency-cap", type=int, help="latency cap in running tokens")
    parser.add_argument(
        "--sim-files", type=parse_files, help="numbers of files to simulate (GPU profile), e.g. 4,8,16"
    )
    parser.add_argument(
        "--no-delay-only", action="store_true", help="measure without the network delay only (tests)"
    )
    parser.add_argument("--plot", metavar="PNG", help="also draw the figure (`plot`) to this file")
    return parser.parse_args(argv)


def build_config(args: argparse.Namespace) -> BenchConfig:
    cfg = sized(
        args,
        FULL,
        QUICK,
        TINY,
        repeats=args.repeats,
        files=args.files,
        rounds=args.rounds,
        brief_tokens=args.brief_tokens,
        latency_cap_tokens=args.latency_cap,
    )
    if args.sim_files is not None:
        cfg = replace(cfg, sim=replace(cfg.sim, files=args.sim_files))
    return cfg


def main(argv: list[str] | None = None) -> None:
    """Run the benchmark (see the module docstring); the last stdout line is the RESULT line."""
    args = parse_args(argv)
    cfg = build_config(args)

    set_threads(args)
    started = time.perf_counter()
    machine = machine_info()
    delays = (False,) if args.no_delay_only else (False, True)
    workflows: list[Workflow] = []
    results: list[FilesResult] = []
    for files in cfg.files:
        log(f"starting four servers ({args.model}) for {files} files ...")
        with serve(args.model, cfg) as servers:  # fresh: nothing cached, so the memory peaks are clean
            workflow, result = asyncio.run(measure_files(servers, cfg, files, delays))
        workflows.append(workflow)
        results.append(result)
    sims = [simulate_files(cfg, files) for files in cfg.sim.files]
    total_s = time.perf_counter() - started
    print_report(cfg, args.model, machine, results, sims, total_s)
    payload = json_payload(cfg, args.model, machine, workflows, results, sims, total_s)
    if args.json:
        write_json(args.json, payload)
    if args.plot:
        plot(payload, Path(args.plot))
    print(result_line(NAME, result_metrics(results, sims, total_s)))


if __name__ == "__main__":
    main()
