"""Shared system prompt: a Bing-Copilot-like app, many users at once (the Parrot paper's Fig. 15/16).

One long "copilot" system prompt (`benchmarks.workloads.copilot`: stdlib docstrings behind a fixed preamble,
``--system-tokens`` tokens, default 6000 as in the paper, clipped to fit the model's context window minus the
longest query and the output — the length actually used is printed and written to the JSON) and ``B``
distinct user queries (20-60 tokens, seeded). All ``B`` requests arrive at once; greedy, EOS ignored, so
every answer has exactly ``--max-tokens`` tokens. Three systems, the same server code and engine code, one
run, on the real engine (the embedded tiny model by default, CPU):

* **parrot** — the app as a Parrot semantic function whose template is the system prompt followed by
  ``{{input:query}}`` and ``{{output:answer}}``; each user is a `parrot` session calling it once and
  ``aget()``-ing the answer (no criteria: the manager schedules it as throughput work, so all ``B`` run
  together, as the baseline's do). The manager makes the constant prefix one shared engine context and
  forks every request from it; decode groups the forks on their shared blocks and reads the prefix once per
  step (`EngineConfig(shared_prefix_decode=...)`, ``--kernel-mode``, default ``"auto"``: the engine's own
  gate `kernels.should_share_prefix` — on CPU it groups when ``(members - 1) * prefix_len *
  kv_bytes_per_token`` reaches 6 MiB per layer, i.e. with the tiny model's 1 KiB per token, 2 members
  sharing 6k tokens or 7 sharing 1k. The table shows how many decode steps were actually grouped).
* **parrot, no kernel** — the same, with ``shared_prefix_decode="never"``: the prefix is filled once and
  its KV blocks are shared, but every decoding sequence reads the whole prefix itself (PagedAttention).
* **no sharing** — the baseline (vLLM without prefix caching): the client renders the same prompts and
  sends ``B`` independent ``POST /v1/completions`` requests; that route never shares a prefix, so every
  request prefills and stores the whole system prompt.

Two servers, one per `EngineConfig` (parrot's, and ``"never"``, which also serves the baseline: its requests
share no blocks, so there is nothing to group anyway), the same number of KV blocks each, enough that nothing
waits for memory. Measured per batch size and system, medians over ``--repeats`` repeats with the systems
interleaved (rotating which goes first), after an untimed warm-up of every system at that batch size that
also checks that the three give identical greedy answers (a difference stops the run):

* **batch latency** — from sending the first request until every answer is in the client's hands (Parrot:
  session creation included, the sessions' ``DELETE`` after the answer not).
* **per-output-token latency** (TPOT) — from the engine's step trace (``EngineConfig(trace_steps=...)``,
  `server.engine.step_features`): every step records how many decodes (one-token chunks, i.e. output tokens
  after a request's first) it ran and its wall time; a request waits one step per output token, so TPOT is
  the decode-weighted mean step time ``sum(decodes_i * seconds_i) / sum(decodes_i)`` over the batch's
  steps — the time between two consecutive output tokens that a request sees, averaged over every output
  token. Steps that also prefill other requests' prompts count (the baseline interleaves its prompts'
  chunked prefill with decodes; that is what its users wait for). **pure-decode TPOT** is the same over
  steps that prefill nothing: the attention path alone (parrot vs no kernel).
* **peak KV blocks** — the largest number of KV-cache blocks in use during the batch, exact: the engine's
  high-water mark (`EngineStats.blocks_peak`, restarted before each batch with
  `LLMEngine.reset_peak_blocks`). Every batch starts from an empty cache (the manager's cached contexts of the
  previous batch are dropped, the system prompt's included), so Parrot pays its one prefill of the system
  prompt inside every timed batch, and the peak counts it. The block count the paged design predicts is
  shown next to it (`expected_blocks`; Parrot: exactly this, nothing is freed during a batch; the baseline:
  the bound with every request alive at its longest — the measured peak is lower when early requests finish
  before late ones are admitted).

Ratios per batch size: latency baseline / parrot (``speedup``) and no-kernel / parrot (``kernel_latency``),
TPOT no-kernel / parrot (``kernel_gain``), peak blocks baseline / parrot (``kv_saving``). Single-shot
requests, so no simulated network delay (it would add the same ~250 ms to both sides).

    python -m benchmarks.shared_prompt [--quick | --tiny] [--json PATH] [--plot PNG] [--model PATH]
        [--repeats N] [--batches B ...] [--system-tokens N] [--max-tokens N] [--kernel-mode auto|always]
    (or python benchmarks/shared_prompt.py ...)

``--quick`` asks for a 1k-token system prompt, batches 4/8/16 and 16 answer tokens (the baseline prefilling
B x 4k tokens per batch would take minutes on 2 CPU cores); ``--tiny`` is a harness check in seconds.

The last line is ``RESULT shared_prompt speedup_b<max>=... kernel_gain_b<max>=... kv_saving_b<max>=... ...``.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

if not __package__:
    # Run as a file, this script's directory would come first on sys.path (where `benchmarks/kernels.py`
    # shadows the `kernels` package); put the repository root there instead.
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import httpx
import parrot as P

from benchmarks.common import (
    Spread,
    add_engine_flags,
    add_size_flags,
    fmt_num,
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
from benchmarks.plotting import pyplot, save
from benchmarks.workloads.copilot import CopilotWorkload, make_workload
from server.engine import EngineConfig, LLMEngine
from server.engine.step_features import StepRecord
from server.launcher import LaunchedServer, launch
from server.serve.manager import ManagerConfig

NAME = "shared_prompt"

PARROT = "parrot"
NO_KERNEL = "parrot, no kernel"
BASELINE = "no sharing"
SYSTEMS = (PARROT, NO_KERNEL, BASELINE)

# Anchors from the Parrot paper (OSDI '24), Fig. 15/16, Bing-Copilot-like workload on an A100 with
# LLaMA-7B: figures of the paper, not of this run (as summarised in this benchmark's issue).
PAPER_ANCHORS = {
    "fig15_latency_speedup_vs_vllm_no_sharing": "up to ~1.8-2.0x lower batch latency (paper)",
    "fig16_kernel_gain_per_output_token": "1.1-1.8x lower per-output-token latency from the kernel (paper)",
    "system_prompt_tokens": "~6k (paper)",
}

KernelMode = Literal["auto", "always"]


@dataclass(frozen=True)
class BenchConfig:
    """What one run measures."""

    batches: tuple[int, ...] = (8, 16, 32, 64)
    system_tokens: int = 6000  # asked for; clipped to the model's window (see `fit_system_tokens`)
    min_query_tokens: int = 20
    max_query_tokens: int = 60
    max_tokens: int = 64  # answer tokens per request
    repeats: int = 3
    kernel_mode: KernelMode = "auto"
    seed: int = 0


FULL = BenchConfig()
QUICK = BenchConfig(batches=(4, 8, 16), system_tokens=1024, max_tokens=16, repeats=4)
# A harness check in seconds (figures mean nothing): every code path, two batch sizes.
TINY = BenchConfig(
    batches=(2, 4), system_tokens=256, min_query_tokens=8, max_query_tokens=16, max_tokens=6, repeats=1
)

# Template text around the query ("\n\nUser: ", "\nCopilot: ") plus BOS, with room to spare: the clip keeps
# every prompt and its answer inside the model's window.
_TEMPLATE_SLACK_TOKENS = 24


# ----------------------------------------------------------------------------------------------- model
def model_facts(model: str) -> tuple[Any, int]:
    """The model's tokenizer and its context window, without loading the weights."""
    from transformers import AutoTokenizer

    from server.engine.config import ModelConfig

    if model == "tiny":
        from server.engine.tiny import TOKENIZER_DIR
        from server.engine.tiny.model import TINY_CONFIG

        folder, config = Path(TOKENIZER_DIR), ModelConfig.from_hf_dict(TINY_CONFIG)
    else:
        folder = Path(model)
        config = ModelConfig.from_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    return tokenizer, config.max_position_embeddings


def fit_system_tokens(cfg: BenchConfig, max_model_len: int) -> int:
    """The system prompt length used: as asked, or less so that the longest prompt plus its answer fit."""
    room = max_model_len - 1 - cfg.max_tokens - cfg.max_query_tokens - _TEMPLATE_SLACK_TOKENS
    if room < 64:
        raise SystemExit(f"the model's window ({max_model_len}) leaves no room for a system prompt")
    return min(cfg.system_tokens, room)


def blocks(n_tokens: int, block_size: int) -> int:
    """Blocks that hold ``n_tokens`` tokens."""
    return -(-n_tokens // block_size)


def engine_configs(cfg: BenchConfig, longest_prompt: int, block_size: int = 16) -> dict[str, EngineConfig]:
    """Per system: the engine defaults, plus enough KV blocks and sequence slots that nothing waits for
    memory (the baseline holds every request's whole prompt at once), and a step trace for TPOT."""
    most = max(cfg.batches)
    # The baseline at the biggest batch with every request at its longest, plus the warm-up's spare.
    num_blocks = most * blocks(longest_prompt + cfg.max_tokens, block_size) + 64
    common = EngineConfig(
        num_kv_blocks=num_blocks,
        max_num_seqs=max(64, most),
        device="cpu",
        trace_steps=100_000,
    )
    return {
        PARROT: replace(common, shared_prefix_decode=cfg.kernel_mode),
        NO_KERNEL: replace(common, shared_prefix_decode="never"),
    }


# ----------------------------------------------------------------------------------------------- server
@dataclass
class Served:
    """One running server and what the measurement watches on its engine."""

    launched: LaunchedServer
    engine: LLMEngine

    @property
    def url(self) -> str:
        return self.launched.url


@contextmanager
def serve(model: str, configs: dict[str, EngineConfig]) -> Iterator[dict[str, Served]]:
    """One server per engine config; the baseline is served by the no-kernel one."""
    with ExitStack() as stack:
        servers: dict[str, Served] = {}
        for name, config in configs.items():
            # The baseline's OpenAI route caches nothing (the paper's vLLM without sharing).
            manager = ManagerConfig(openai_prefix_cache=False)
            launched = stack.enter_context(
                launch(model, engine_config=config, manager_config=manager, startup_timeout=120)
            )
            engine = launched.engines[0]
            assert isinstance(engine, LLMEngine)
            servers[name] = Served(launched, engine)
        servers[BASELINE] = servers[NO_KERNEL]
        yield servers


def drop_cached_contexts(served: Served) -> int:
    """Free every context the manager keeps as a shareable prefix (the system prompt's and the finished
    requests'), so that the next batch starts from an empty KV cache; returns how many were dropped.

    Run between batches only (nothing in flight). Goes through the manager's private prefix store: the
    manager has no public call for this (a ``Manager.drop_cached_prefixes()`` would do).
    """
    manager = served.launched.manager
    store = manager._prefixes  # private: see the docstring

    async def drop() -> int:
        entries = [e for engine_id in store.engines() for e in store.entries(engine_id)]
        for entry in entries:
            store.remove(entry)
            await manager._free(int(entry.engine_id), entry.context_id)
        return len(entries)

    return asyncio.run(drop())


def wait_for_empty_cache(engine: LLMEngine, timeout: float = 10.0) -> None:
    """Wait until no KV block is in use: the OpenAI route frees a context just after answering."""
    deadline = time.monotonic() + timeout
    while engine.stats().blocks_used:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{engine.stats().blocks_used} KV blocks still in use between batches")
        time.sleep(0.005)


# ----------------------------------------------------------------------------------------------- clients
@dataclass
class BatchRun:
    """One batch: the time until every answer was back, and the answers in query order."""

    seconds: float
    outputs: list[str]


def copilot_function(workload: CopilotWorkload, max_tokens: int) -> P.SemanticFunction:
    """The app as a Parrot semantic function (greedy, EOS ignored: every answer is ``max_tokens`` long)."""
    sampling = P.SamplingConfig(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return P.SemanticFunction.from_template(workload.template, name="copilot", sampling=sampling)


async def run_parrot(url: str, fn: P.SemanticFunction, queries: Sequence[str]) -> BatchRun:
    """``len(queries)`` users at once, each a `parrot` session that calls the app and gets the answer."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        done: list[float] = []

        async def user(query: str) -> str:
            async with P.Session(url, client=client, timeout=600):
                answer = fn(query=query)
                assert isinstance(answer, P.Variable)
                value = str(await answer.aget())
                done.append(time.perf_counter())  # the answer is in hand; the session's DELETE is not timed
            return value

        start = time.perf_counter()
        outputs = await asyncio.gather(*(user(q) for q in queries))
    return BatchRun(max(done) - start, list(outputs))


async def run_baseline(url: str, model_name: str, prompts: Sequence[str], max_tokens: int) -> BatchRun:
    """``len(prompts)`` independent ``POST /v1/completions`` at once, prompts rendered by the client."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:

        async def complete(prompt: str) -> str:
            body = {
                "model": model_name,
                "prompt": prompt,
                "max_tokens": max_tokens,
                "temperature": 0,
                "ignore_eos": True,
            }
            response = await client.post("/v1/completions", json=body)
            response.raise_for_status()
            return str(response.json()["choices"][0]["text"])

        start = time.perf_counter()
        outputs = await asyncio.gather(*(complete(p) for p in prompts))
        seconds = time.perf_counter() - start
    return BatchRun(seconds, list(outputs))


# ----------------------------------------------------------------------------------------------- measuring
@dataclass
class Sample:
    """One system, one batch, one repeat."""

    seconds: float
    tpot_s: float
    tpot_pure_s: float
    peak_blocks: int
    decode_steps: int
    grouped_decode_steps: int
    prefill_tokens: int
    outputs: list[str] = field(repr=False)


def tpot(trace: Sequence[StepRecord], pure: bool = False) -> float:
    """Decode-weighted mean step time (see the module docstring); ``pure``: steps that prefill nothing."""
    steps = [r for r in trace if r.features.decode_seqs and not (pure and r.features.prefill_tokens)]
    tokens = sum(r.features.decode_seqs for r in steps)
    return safe_ratio(sum(r.features.decode_seqs * r.seconds for r in steps), tokens)


class Runner:
    """Runs one system's batch on its server from an empty KV cache and collects a `Sample`."""

    def __init__(self, servers: dict[str, Served], workload: CopilotWorkload, max_tokens: int) -> None:
        self.servers = servers
        self.workload = workload
        self.max_tokens = max_tokens
        self.fn = copilot_function(workload, max_tokens)

    def run(self, system: str, batch: int) -> Sample:
        served = self.servers[system]
        engine = served.engine
        drop_cached_contexts(served)
        wait_for_empty_cache(engine)
        assert engine.step_trace is not None
        engine.step_trace.clear()
        engine.reset_peak_blocks()
        before = engine.stats()
        queries = self.workload.queries[:batch]
        if system == BASELINE:
            run = asyncio.run(
                run_baseline(served.url, engine.model_name, self.workload.prompts(batch), self.max_tokens)
            )
        else:
            run = asyncio.run(run_parrot(served.url, self.fn, queries))
        wait_for_idle(engine)
        after = engine.stats()
        trace = list(engine.step_trace)
        drop_cached_contexts(served)
        return Sample(
            seconds=run.seconds,
            tpot_s=tpot(trace),
            tpot_pure_s=tpot(trace, pure=True),
            peak_blocks=after.blocks_peak,
            decode_steps=sum(1 for r in trace if r.features.decode_seqs),
            grouped_decode_steps=after.grouped_decode_steps - before.grouped_decode_steps,
            prefill_tokens=after.prefill_tokens_computed - before.prefill_tokens_computed,
            outputs=run.outputs,
        )


def wait_for_idle(engine: LLMEngine, timeout: float = 10.0) -> None:
    """Wait until the engine runs nothing (answers are back; a free may still be in flight)."""
    deadline = time.monotonic() + timeout
    while (s := engine.stats()).running or s.waiting:
        if time.monotonic() > deadline:
            raise RuntimeError("the engine is still busy after the batch")
        time.sleep(0.005)


@dataclass
class SystemResult:
    """One system at one batch size over the repeats."""

    seconds: list[float] = field(default_factory=list)
    tpot_s: list[float] = field(default_factory=list)
    tpot_pure_s: list[float] = field(default_factory=list)
    peak_blocks: list[int] = field(default_factory=list)
    decode_steps: list[int] = field(default_factory=list)
    grouped_decode_steps: list[int] = field(default_factory=list)
    prefill_tokens: list[int] = field(default_factory=list)
    same_as_verified: list[bool] = field(default_factory=list)  # answers equal to the warm-up's
    expected_blocks: int = 0

    def add(self, sample: Sample, verified: list[str]) -> None:
        self.seconds.append(sample.seconds)
        self.tpot_s.append(sample.tpot_s)
        self.tpot_pure_s.append(sample.tpot_pure_s)
        self.peak_blocks.append(sample.peak_blocks)
        self.decode_steps.append(sample.decode_steps)
        self.grouped_decode_steps.append(sample.grouped_decode_steps)
        self.prefill_tokens.append(sample.prefill_tokens)
        self.same_as_verified.append(sample.outputs == verified)

    @property
    def latency(self) -> Spread:
        return Spread.of(self.seconds)

    @property
    def tpot(self) -> Spread:
        return Spread.of(self.tpot_s)

    @property
    def tpot_pure(self) -> Spread:
        return Spread.of(self.tpot_pure_s)

    @property
    def peak(self) -> int:
        """The largest peak over the repeats (Parrot's is the same every time; the baseline's may vary
        with how the requests' arrival splits across steps)."""
        return max(self.peak_blocks, default=0)

    def as_dict(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "latency": self.latency.as_dict(),
            "tpot": self.tpot.as_dict(),
            "tpot_pure": self.tpot_pure.as_dict(),
            "peak_blocks_max": self.peak,
        }


@dataclass
class BatchResult:
    """The three systems at one batch size."""

    batch: int
    prompt_tokens: list[int]  # per request, BOS included (what the baseline prefills each)
    shared_prefix_tokens: int  # the constant prefix the manager shares (BOS included)
    systems: dict[str, SystemResult]
    repeats: int

    def ratios(self) -> dict[str, float]:
        s = self.systems
        return {
            "speedup": safe_ratio(s[BASELINE].latency.median, s[PARROT].latency.median),
            "speedup_no_kernel": safe_ratio(s[BASELINE].latency.median, s[NO_KERNEL].latency.median),
            "kernel_latency": safe_ratio(s[NO_KERNEL].latency.median, s[PARROT].latency.median),
            "kernel_gain": safe_ratio(s[NO_KERNEL].tpot.median, s[PARROT].tpot.median),
            "kernel_gain_pure": safe_ratio(s[NO_KERNEL].tpot_pure.median, s[PARROT].tpot_pure.median),
            "tpot_vs_baseline": safe_ratio(s[BASELINE].tpot.median, s[PARROT].tpot.median),
            "kv_saving": safe_ratio(s[BASELINE].peak, s[PARROT].peak),
        }


def shared_prefix(tokenizer: Any, workload: CopilotWorkload, prompt_ids: list[int]) -> int:
    """The manager's shared constant prefix of a prompt, in tokens (as `Manager._constant_prefix` finds it:
    the constant text's tokens, cut back to a true prefix of the whole prompt's tokens)."""
    constant = workload.prompts(1)[0][: -len(workload.queries[0])]  # the rendered text before the query
    prefix = tokenizer.encode(constant)
    while prefix and prompt_ids[: len(prefix)] != prefix:
        prefix.pop()
    return len(prefix)


def expected_blocks(
    prompt_ids: list[list[int]], prefix: int, new_tokens: int, block_size: int
) -> dict[str, int]:
    """KV blocks the paged design predicts with every context alive at its end.

    A request generating ``G`` tokens has KV for its prompt and ``G - 1`` of them (the last sampled token is
    never fed back). Parrot: the prefix context's blocks once, plus per request the blocks of its whole
    context beyond the prefix's full blocks (a fork shares the parent's full blocks; a partial last block
    is copied on the child's first write). No sharing: every request's whole context.
    """
    cached = [len(p) + new_tokens - 1 for p in prompt_ids]
    return {
        "parrot": blocks(prefix, block_size)
        + sum(blocks(c, block_size) - prefix // block_size for c in cached),
        "no_sharing": sum(blocks(c, block_size) for c in cached),
    }


def verify(runner: Runner, batch: int) -> dict[str, list[str]]:
    """Untimed warm-up of every system that doubles as the check that their greedy answers are identical;
    a difference stops the run. Returns the answers per system."""
    answers = {system: runner.run(system, batch).outputs for system in SYSTEMS}
    for system in (PARROT, NO_KERNEL):
        for i, (a, b) in enumerate(zip(answers[system], answers[BASELINE], strict=True)):
            if a != b:
                raise SystemExit(
                    f"greedy answers differ for query {i + 1} ({system} vs {BASELINE}):\n"
                    f"  {system}: {a!r}\n  {BASELINE}: {b!r}"
                )
    return answers


def measure_batch(runner: Runner, tokenizer: Any, batch: int, cfg: BenchConfig) -> BatchResult:
    """Warm up and verify at this batch size, then ``cfg.repeats`` interleaved repeats of every system."""
    workload = runner.workload
    prompt_ids = [tokenizer.encode(p) for p in workload.prompts(batch)]
    prefix = shared_prefix(tokenizer, workload, prompt_ids[0])
    expected = expected_blocks(prompt_ids, prefix, cfg.max_tokens, runner.servers[PARROT].engine.block_size)
    verified = verify(runner, batch)[BASELINE]
    results = {name: SystemResult() for name in SYSTEMS}
    results[PARROT].expected_blocks = results[NO_KERNEL].expected_blocks = expected["parrot"]
    results[BASELINE].expected_blocks = expected["no_sharing"]
    for rep in range(cfg.repeats):
        order = SYSTEMS[rep % len(SYSTEMS) :] + SYSTEMS[: rep % len(SYSTEMS)]
        for system in order:
            results[system].add(runner.run(system, batch), verified)
        log(
            f"  b{batch} repeat {rep + 1}: "
            + " | ".join(
                f"{n} {r.seconds[-1]:.3f}s tpot {r.tpot_s[-1] * 1e3:.2f}ms {r.peak_blocks[-1]} blk"
                for n, r in results.items()
            )
        )
    return BatchResult(batch, [len(p) for p in prompt_ids], prefix, results, cfg.repeats)


# ----------------------------------------------------------------------------------------------- report
def results_table(results: list[BatchResult]) -> str:
    """Latency, TPOT and peak KV blocks per batch size and system, with the ratios to Parrot."""
    rows = []
    for r in results:
        ratios = r.ratios()
        for name in SYSTEMS:
            s = r.systems[name]
            lat, tp = s.latency, s.tpot
            grouped = f"{s.grouped_decode_steps[-1]}/{s.decode_steps[-1]}" if s.decode_steps else ""
            vs = {
                PARROT: "",
                NO_KERNEL: f"{ratios['kernel_latency']:.2f}x / {ratios['kernel_gain']:.2f}x",
                BASELINE: f"{ratios['speedup']:.2f}x / {ratios['tpot_vs_baseline']:.2f}x",
            }[name]
            rows.append(
                [
                    str(r.batch),
                    name,
                    f"{lat.median:.3f} ±{lat.rel_half_range:.0%}",
                    f"{tp.median * 1e3:.2f} ±{tp.rel_half_range:.0%}",
                    f"{s.tpot_pure.median * 1e3:.2f}",
                    f"{fmt_num(s.peak)} ({fmt_num(s.expected_blocks)})",
                    grouped,
                    vs,
                ]
            )
    return markdown_table(
        [
            "batch",
            "system",
            "latency s",
            "TPOT ms",
            "pure-decode TPOT ms",
            "peak KV blocks (expected)",
            "grouped / decode steps",
            "this / parrot: latency / TPOT",
        ],
        rows,
        [True, False, True, True, True, True, True, True],
    )


def print_report(
    cfg: BenchConfig,
    model: str,
    machine: dict[str, Any],
    workload: CopilotWorkload,
    results: list[BatchResult],
    total_s: float,
) -> None:
    """The markdown table and what it measured, on stdout."""
    print(
        f"## shared_prompt — {model}, {machine['cpu_model']}, {machine['usable_cores']} cores, "
        f"torch {machine['torch']} ({machine['torch_threads']} threads), "
        f"load average {machine['load_average_1m']} at start\n"
    )
    last = results[-1]
    print(
        f"system prompt {workload.system_prompt_tokens} tokens (asked {cfg.system_tokens}; shared prefix "
        f"{last.shared_prefix_tokens} tokens with BOS), queries "
        f"{cfg.min_query_tokens}-{cfg.max_query_tokens} tokens, prompts "
        f"{min(last.prompt_tokens)}-{max(last.prompt_tokens)} tokens, {cfg.max_tokens} answer tokens "
        "(greedy, EOS ignored); all B requests at once, no network delay (single-shot requests). "
        f"Median of {cfg.repeats} repeats, systems interleaved, after a warm-up that checked identical "
        f"answers; ± half the range. TPOT = decode-weighted mean engine step time; pure-decode TPOT = the "
        f"same over steps without prefill. Shared-prefix decode: {cfg.kernel_mode!r} for parrot, 'never' for "
        "the others; grouped / decode steps from the last repeat.\n"
    )
    print(results_table(results) + "\n")
    print(
        "paper (Fig. 15/16, A100, LLaMA-7B): "
        + "; ".join(PAPER_ANCHORS.values())
        + f". Measured here on CPU with the tiny model: see the table. total {total_s:.0f}s"
    )


def json_payload(
    cfg: BenchConfig,
    model: str,
    configs: dict[str, EngineConfig],
    machine: dict[str, Any],
    workload: CopilotWorkload,
    max_model_len: int,
    results: list[BatchResult],
    total_s: float,
) -> dict[str, Any]:
    """Every figure, the raw per-repeat values, and what is needed to reproduce or judge them."""
    return {
        "benchmark": NAME,
        "config": asdict(cfg),
        "model": {"name": model, "max_model_len": max_model_len},
        "engine_configs": {
            PARROT: asdict(configs[PARROT]),
            NO_KERNEL: asdict(configs[NO_KERNEL]),
            BASELINE: f"served by the {NO_KERNEL!r} engine (OpenAI route: no sharing)",
        },
        "system_prompt_tokens": {"asked": cfg.system_tokens, "used": workload.system_prompt_tokens},
        "machine": machine,
        "load_average_1m_at_end": load_average(),
        "definitions": {
            "latency": "seconds from the first request sent to the last answer in hand",
            "tpot": "sum(decodes_i * step_seconds_i) / sum(decodes_i) over the batch's engine steps",
            "tpot_pure": "the same over steps that prefill nothing",
            "peak_blocks": "high-water mark of KV blocks in use during the batch, from an empty cache",
            "expected_blocks": "blocks with every context alive at its end (parrot: exact; baseline: bound)",
            "speedup": "no-sharing latency / parrot latency (medians)",
            "kernel_gain": "no-kernel TPOT / parrot TPOT (medians)",
            "kv_saving": "no-sharing peak blocks / parrot peak blocks",
        },
        "network_delay": None,
        "outputs_identical": True,
        "batches": [
            {
                "batch": r.batch,
                "repeats": r.repeats,
                "prompt_tokens": r.prompt_tokens,
                "shared_prefix_tokens": r.shared_prefix_tokens,
                "systems": {name: s.as_dict() for name, s in r.systems.items()},
                "ratios": r.ratios(),
            }
            for r in results
        ],
        "paper_anchors": PAPER_ANCHORS,
        "total_s": total_s,
    }


def result_metrics(
    results: list[BatchResult], workload: CopilotWorkload, total_s: float
) -> dict[str, float | int]:
    """The RESULT line: the headline ratios at the biggest batch, then per batch size, then raw figures."""
    top = max(results, key=lambda r: r.batch)
    b = top.batch
    ratios = top.ratios()
    metrics: dict[str, float | int] = {
        f"speedup_b{b}": ratios["speedup"],
        f"kernel_gain_b{b}": ratios["kernel_gain"],
        f"kv_saving_b{b}": ratios["kv_saving"],
    }
    for r in results:
        if r is not top:
            metrics[f"speedup_b{r.batch}"] = r.ratios()["speedup"]
    for r in results:
        if r is not top:
            metrics[f"kernel_gain_b{r.batch}"] = r.ratios()["kernel_gain"]
    for r in results:
        if r is not top:
            metrics[f"kv_saving_b{r.batch}"] = r.ratios()["kv_saving"]
    metrics[f"parrot_s_b{b}"] = top.systems[PARROT].latency.median
    metrics[f"baseline_s_b{b}"] = top.systems[BASELINE].latency.median
    metrics[f"parrot_tpot_ms_b{b}"] = top.systems[PARROT].tpot.median * 1e3
    metrics[f"no_kernel_tpot_ms_b{b}"] = top.systems[NO_KERNEL].tpot.median * 1e3
    metrics["system_tokens"] = workload.system_prompt_tokens
    metrics["total_s"] = total_s
    return metrics


# ----------------------------------------------------------------------------------------------- plot
def plot(payload: dict[str, Any], path: Path) -> None:
    """Batch latency, per-output-token latency and peak KV blocks against batch size, per system (PNG)."""
    plt = pyplot()

    rows = payload["batches"]
    xs = [r["batch"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    panels = (
        ("batch latency (s)", lambda s: s["latency"]["median"]),
        ("per-output-token latency (ms)", lambda s: s["tpot"]["median"] * 1e3),
        ("peak KV blocks", lambda s: s["peak_blocks_max"]),
    )
    for ax, (label, value) in zip(axes, panels, strict=True):
        # Dashed/dotted lines: parrot and no-kernel hold the same KV blocks, one line would hide the other.
        for name, marker, style in zip(SYSTEMS, ("o", "s", "^"), ("-", "--", ":"), strict=True):
            ys = [value(r["systems"][name]) if r["systems"][name]["seconds"] else float("nan") for r in rows]
            ax.plot(xs, ys, marker=marker, linestyle=style, label=name)
        ax.set_xlabel("batch size (requests at once)")
        ax.set_ylabel(label)
        ax.set_xticks(xs)
        ax.grid(True, alpha=0.3)
    axes[0].legend()
    tokens = payload["system_prompt_tokens"]["used"]
    fig.suptitle(f"shared system prompt ({tokens} tokens), {payload['model']['name']}: Fig. 15/16 analogue")
    save(fig, path)


# ----------------------------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_size_flags(parser, "1k-token system prompt, batches 4 8 16, 4 repeats (~1 min)")
    parser.add_argument("--plot", metavar="PATH", help="also write the figure (PNG)")
    add_engine_flags(parser)
    parser.add_argument("--repeats", type=int, help="timed repeats per batch size and system (median)")
    parser.add_argument("--batches", type=int, nargs="+", help="batch sizes (default 8 16 32 64)")
    parser.add_argument("--system-tokens", type=int, help="system prompt tokens asked for (default 6000)")
    parser.add_argument("--query-tokens", type=int, nargs=2, metavar=("MIN", "MAX"), help="query lengths")
    parser.add_argument("--max-tokens", type=int, help="answer tokens per request")
    parser.add_argument("--kernel-mode", choices=("auto", "always"), help="parrot's shared_prefix_decode")
    return parser.parse_args(argv)


def build_config(args: argparse.Namespace) -> BenchConfig:
    lo, hi = args.query_tokens or (None, None)
    return sized(
        args,
        FULL,
        QUICK,
        TINY,
        repeats=args.repeats,
        batches=tuple(sorted(set(args.batches))) if args.batches else None,
        system_tokens=args.system_tokens,
        min_query_tokens=lo,
        max_query_tokens=hi,
        max_tokens=args.max_tokens,
        kernel_mode=args.kernel_mode,
    )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    cfg = build_config(args)
    import transformers

    set_threads(args)
    # Quiet: the over-long-sequence warning of tokenizing the whole workload text at once.
    transformers.utils.logging.set_verbosity_error()
    started = time.perf_counter()
    machine = machine_info()
    tokenizer, max_model_len = model_facts(args.model)
    used = fit_system_tokens(cfg, max_model_len)
    workload = make_workload(
        tokenizer, used, max(cfg.batches), cfg.seed, cfg.min_query_tokens, cfg.max_query_tokens
    )
    longest = max(len(tokenizer.encode(p)) for p in workload.prompts(max(cfg.batches)))
    if longest + cfg.max_tokens >= max_model_len:
        raise SystemExit(f"a prompt of {longest} tokens plus the answer exceeds the window ({max_model_len})")
    configs = engine_configs(cfg, longest)
    log(f"system prompt {used} tokens (asked {cfg.system_tokens}); starting two servers ({args.model}) ...")
    results: list[BatchResult] = []
    with serve(args.model, configs) as servers:
        runner = Runner(servers, workload, cfg.max_tokens)
        for batch in cfg.batches:
            log(f"batch {batch}: verifying answers and warming up ...")
            results.append(measure_batch(runner, tokenizer, batch, cfg))
    total_s = time.perf_counter() - started
    print_report(cfg, args.model, machine, workload, results, total_s)
    payload = json_payload(cfg, args.model, configs, machine, workload, max_model_len, results, total_s)
    if args.json:
        write_json(args.json, payload)
    if args.plot:
        plot(payload, Path(args.plot))
    print(result_line(NAME, result_metrics(results, workload, total_s)))


if __name__ == "__main__":
    main()
