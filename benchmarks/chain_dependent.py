"""Dependent chain: Parrot (submit all calls, one ``get``) vs request-centric calls, one server, one run.

A chain summary of ``steps`` document chunks (stdlib docstrings): step *i* reads the summary written by
step *i - 1* plus chunk *i* and writes the next summary (greedy, ``max_tokens`` tokens each, EOS ignored
so every step writes exactly that many). Two clients of the same server and the same engine:

* **parrot** — the `parrot` frontend: in one ``P.Session``, the ``steps`` semantic-function calls are
  queued (each call's input is the previous call's output variable), then one
  ``get(criteria=P.LATENCY)`` of the last summary. The client sends its queue at the ``get`` — one
  request per queued call — and the server runs the chain without the client in between.
* **parrot, criteria at submit** — the same, but the semantic function carries ``criteria=P.LATENCY``, so
  the server starts each step as soon as it is submitted and its input exists, while the client is still
  sending the rest of the queue.
* **baseline** — what a LangChain app does against an OpenAI-style service: the client renders each
  prompt itself (the same template text, the previous output substituted), calls ``POST /v1/completions``
  (``temperature=0``, the same ``max_tokens``), waits for the answer, renders the next prompt.

End-to-end latency of one chain is measured from the first request to the last summary in the client's
hands (Parrot: session creation included, the session's ``DELETE`` after the result not). Two settings on
the same server: without network delay, and with a simulated client network delay of ``U(0.2, 0.3)`` s
per HTTP request (`server.netdelay.NetworkDelayMiddleware`, the paper's 200-300 ms, switched on at run
time). Figures are medians over ``--repeats`` chains per client, clients interleaved (alternating which
goes first), after an untimed warm-up; the spread (``±``) is half the range. Before timing, every step's
output of the Parrot chain is checked to equal the baseline's (greedy on both sides); a difference stops
the run.

    python -m benchmarks.chain_dependent [--quick] [--json PATH] [--model PATH] [--repeats N]
    (or python benchmarks/chain_dependent.py ...)

The last line is
``RESULT chain_dependent speedup_delay=... speedup_nodelay=... parrot_s=... baseline_s=...``
(speedup = baseline / parrot median latency; ``parrot_s`` / ``baseline_s`` are the medians with delay).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

if not __package__:
    # Run as a file, this script's directory would come first on sys.path (where `benchmarks/kernels.py`
    # shadows the `kernels` package); put the repository root there instead.
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import httpx
import parrot as P

from benchmarks.common import (
    ClientResult,
    Spread,
    add_engine_flags,
    document_chunks,
    load_average,
    log,
    machine_info,
    markdown_table,
    render_template,
    result_line,
    safe_ratio,
    set_threads,
    write_json,
)
from server.engine import EngineConfig, LLMEngine
from server.launcher import launch
from server.netdelay import NetworkDelayMiddleware
from server.serve.manager import ManagerConfig

NAME = "chain_dependent"

TEMPLATE = """You are summarizing a long document one part at a time.
Summary of the document so far: {{input:previous}}
Next part of the document:
{{input:chunk}}
Updated summary of the document so far: {{output:summary}}"""

FIRST_SUMMARY = "(nothing yet)"

PARROT = "parrot"
PARROT_SUBMIT = "parrot, criteria at submit"
BASELINE = "baseline"
CLIENTS = (PARROT, PARROT_SUBMIT, BASELINE)


@dataclass(frozen=True)
class BenchConfig:
    """What one run measures."""

    steps: int = 10
    chunk_tokens: int = 128  # new document text per step
    max_tokens: int = 32  # summary tokens written per step
    repeats: int = 5
    delay_low_s: float = 0.2
    delay_high_s: float = 0.3
    seed: int = 0


FULL = BenchConfig()
QUICK = BenchConfig(chunk_tokens=32, max_tokens=8, repeats=3)


# ----------------------------------------------------------------------------------------------- server
@dataclass
class Served:
    """The running server: base URL, the delay middleware (switched per setting) and the engine."""

    url: str
    delay: NetworkDelayMiddleware
    engine: LLMEngine
    model_name: str


@contextmanager
def serve(model: str, engine_config: EngineConfig, cfg: BenchConfig) -> Iterator[Served]:
    """The whole service (`server.launch`) behind the delay middleware, which starts switched off."""
    with launch(
        model,
        engine_config=engine_config,
        manager_config=ManagerConfig(openai_prefix_cache=False),  # baseline: no OpenAI-route cache
        startup_timeout=120,
        network_delay=(cfg.delay_low_s, cfg.delay_high_s),
        network_delay_seed=cfg.seed,
    ) as launched:
        assert launched.network_delay is not None
        launched.network_delay.enabled = False
        engine = launched.engines[0]
        yield Served(launched.url, launched.network_delay, engine, engine.model_name)


# ----------------------------------------------------------------------------------------------- workload
def semantic_functions(cfg: BenchConfig) -> dict[str, P.SemanticFunction]:
    """The chain step as a semantic function: plain, and with ``criteria=P.LATENCY`` at submit."""

    def summarize(previous: Any, chunk: Any) -> None: ...

    summarize.__doc__ = TEMPLATE
    options: dict[str, Any] = {"max_tokens": cfg.max_tokens, "temperature": 0.0, "ignore_eos": True}
    return {
        PARROT: P.semantic_function(**options)(summarize),
        PARROT_SUBMIT: P.semantic_function(**options, criteria=P.LATENCY)(summarize),
    }


def render_prompt(values: dict[str, str]) -> str:
    """The baseline's client-side rendering of the step (exactly what the Parrot server renders)."""
    return render_template(TEMPLATE, values)


# ----------------------------------------------------------------------------------------------- clients
@dataclass
class ChainRun:
    """One chain: latency to the last output, every output the client saw, requests it made."""

    seconds: float
    outputs: list[str]
    requests: int
    seconds_with_close: float


def run_parrot(
    served: Served, fn: P.SemanticFunction, chunks: list[str], all_outputs: bool = False
) -> ChainRun:
    """Submit every step, then one ``get`` of the last; ``all_outputs`` also fetches the others (untimed)."""
    before = served.delay.requests_delayed
    start = time.perf_counter()
    with P.Session(served.url):
        previous: str | P.Variable = FIRST_SUMMARY
        made: list[P.Variable] = []
        for chunk in chunks:
            out = fn(previous, chunk)
            assert isinstance(out, P.Variable)
            made.append(out)
            previous = out
        last = made[-1].get(criteria=P.LATENCY)
        seconds = time.perf_counter() - start
        outputs = [v.get() for v in made[:-1]] + [last] if all_outputs else [last]
    return ChainRun(seconds, outputs, served.delay.requests_delayed - before, time.perf_counter() - start)


def run_baseline(served: Served, client: httpx.Client, chunks: list[str], max_tokens: int) -> ChainRun:
    """Render, call ``/v1/completions``, wait, repeat: one client round trip per step."""
    before = served.delay.requests_delayed
    start = time.perf_counter()
    previous = FIRST_SUMMARY
    outputs: list[str] = []
    for chunk in chunks:
        body = {
            "model": served.model_name,
            "prompt": render_prompt({"previous": previous, "chunk": chunk}),
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
        }
        r = client.post("/v1/completions", json=body)
        r.raise_for_status()
        previous = r.json()["choices"][0]["text"]
        outputs.append(previous)
    seconds = time.perf_counter() - start
    return ChainRun(seconds, outputs, served.delay.requests_delayed - before, seconds)


# ----------------------------------------------------------------------------------------------- measuring
@dataclass
class ChainClientResult(ClientResult):
    """A client of the chain benchmark; also the latency including the session's close."""

    seconds_with_close: list[float] = field(default_factory=list)


@dataclass
class SettingResult:
    """All clients in one setting (with or without the simulated network delay)."""

    delay: bool
    clients: dict[str, ChainClientResult]
    repeats: int

    def speedup(self, client: str) -> float:
        """Baseline median latency over ``client``'s."""
        return safe_ratio(self.clients[BASELINE].spread.median, self.clients[client].spread.median)

    def speedup_range(self, client: str) -> tuple[float, float]:
        """The range of the per-repeat ratios (repeat i of the baseline over repeat i of ``client``)."""
        ratios = [
            safe_ratio(b, p)
            for b, p in zip(self.clients[BASELINE].seconds, self.clients[client].seconds, strict=True)
        ]
        s = Spread.of(ratios)
        return s.lo, s.hi


def verify(
    served: Served,
    client: httpx.Client,
    fns: dict[str, P.SemanticFunction],
    chunks: list[str],
    cfg: BenchConfig,
) -> int:
    """Every step's output equal between Parrot and the baseline (greedy); stops the run otherwise.

    Returns the number of steps compared. Untimed; doubles as the warm-up of every client.
    """
    base = run_baseline(served, client, chunks, cfg.max_tokens).outputs
    for name in (PARROT, PARROT_SUBMIT):
        got = run_parrot(served, fns[name], chunks, all_outputs=True).outputs
        for i, (a, b) in enumerate(zip(got, base, strict=True)):
            if a != b:
                raise SystemExit(
                    f"outputs differ at step {i + 1} ({name} vs baseline):\n"
                    f"  {name}: {a!r}\n  baseline: {b!r}"
                )
    return len(base)


def measure_setting(
    served: Served,
    client: httpx.Client,
    fns: dict[str, P.SemanticFunction],
    chunks: list[str],
    cfg: BenchConfig,
    delay: bool,
    expected_last: str,
    clients: tuple[str, ...] = CLIENTS,
) -> SettingResult:
    """``cfg.repeats`` chains per client, interleaved, rotating which client goes first.

    ``clients``: which of `CLIENTS` to measure (all by default; `BASELINE` must be one of them).
    """
    served.delay.enabled = delay
    results = {name: ChainClientResult() for name in clients}
    runners: dict[str, Callable[[], ChainRun]] = {
        PARROT: lambda: run_parrot(served, fns[PARROT], chunks),
        PARROT_SUBMIT: lambda: run_parrot(served, fns[PARROT_SUBMIT], chunks),
        BASELINE: lambda: run_baseline(served, client, chunks, cfg.max_tokens),
    }
    try:
        for rep in range(cfg.repeats):
            order = clients[rep % len(clients) :] + clients[: rep % len(clients)]
            for name in order:
                run = runners[name]()
                if run.outputs[-1] != expected_last:
                    raise SystemExit(f"{name}: the last output changed between runs (not deterministic?)")
                results[name].seconds.append(run.seconds)
                results[name].seconds_with_close.append(run.seconds_with_close)
                results[name].requests.append(run.requests)
            log(
                f"  {'delay' if delay else 'no delay'} repeat {rep + 1}: "
                + " | ".join(f"{n} {r.seconds[-1]:.3f}s" for n, r in results.items())
            )
    finally:
        served.delay.enabled = False
    return SettingResult(delay=delay, clients=results, repeats=cfg.repeats)


# ----------------------------------------------------------------------------------------------- report
def results_table(settings: list[SettingResult]) -> str:
    """Median latency per chain, spread, requests, and the ratio to Parrot, per setting and client."""
    rows = []
    for st in settings:
        for name in CLIENTS:
            c = st.clients[name]
            s = c.spread
            lo, hi = st.speedup_range(name)
            speed = "" if name == BASELINE else f"{st.speedup(name):.2f}x ({lo:.2f}-{hi:.2f})"
            rows.append(
                [
                    "250 ms (0.2-0.3 s)" if st.delay else "none",
                    name,
                    f"{s.median:.3f} ±{s.rel_half_range:.0%}",
                    f"{s.lo:.3f}-{s.hi:.3f}",
                    str(c.requests[0]) if st.delay and c.requests else "",
                    speed,
                ]
            )
    return markdown_table(
        ["network delay", "client", "latency s (median)", "range s", "requests/chain", "baseline / this"],
        rows,
        [False, False, True, True, True, True],
    )


def print_report(
    cfg: BenchConfig,
    model: str,
    machine: dict[str, Any],
    settings: list[SettingResult],
    prompt_tokens: list[int],
    total_s: float,
) -> None:
    print(
        f"## chain_dependent — {model}, {machine['cpu_model']}, {machine['usable_cores']} cores, "
        f"torch {machine['torch']} ({machine['torch_threads']} threads), "
        f"load average {machine['load_average_1m']} at start\n"
    )
    print(
        f"{cfg.steps} dependent steps (chain summary), chunks of {cfg.chunk_tokens} tokens, "
        f"{cfg.max_tokens} output tokens per step (greedy, EOS ignored), prompts "
        f"{min(prompt_tokens)}-{max(prompt_tokens)} tokens; end-to-end latency of one chain, median of "
        f"{cfg.repeats} chains per client after a warm-up, ± half the range; outputs identical between "
        "Parrot and the baseline at every step (checked). Requests/chain: HTTP requests the client made "
        "(Parrot: session create + one per call + get + delete).\n"
    )
    print(results_table(settings) + "\n")
    print(f"paper anchor (Fig. 11, chain summary): 1.38x-1.88x. total {total_s:.0f}s")


def json_payload(
    cfg: BenchConfig,
    model: str,
    engine_config: EngineConfig,
    machine: dict[str, Any],
    settings: list[SettingResult],
    prompt_tokens: list[int],
    total_s: float,
) -> dict[str, Any]:
    """Every figure, the raw times, and what is needed to reproduce or judge them."""
    return {
        "benchmark": NAME,
        "config": asdict(cfg),
        "model": model,
        "engine_config": {k: str(v) for k, v in asdict(engine_config).items()},
        "template": TEMPLATE,
        "prompt_tokens_per_step": prompt_tokens,
        "machine": machine,
        "load_average_1m_at_end": load_average(),
        "outputs_identical": True,
        "settings": [
            {
                "network_delay": st.delay,
                "delay_s": [cfg.delay_low_s, cfg.delay_high_s] if st.delay else None,
                "repeats": st.repeats,
                "clients": {
                    name: {
                        **asdict(c),
                        "latency": c.spread.as_dict(),
                        "speedup_vs_baseline": st.speedup(name),
                        "speedup_range": list(st.speedup_range(name)),
                    }
                    for name, c in st.clients.items()
                },
            }
            for st in settings
        ],
        "paper_anchor": [1.38, 1.88],
        "total_s": total_s,
    }


def result_metrics(settings: list[SettingResult], total_s: float) -> dict[str, float | int]:
    """The RESULT line: the speedups first, then the medians (with delay) and the other variant."""
    nodelay, delay = settings
    return {
        "speedup_delay": delay.speedup(PARROT),
        "speedup_nodelay": nodelay.speedup(PARROT),
        "parrot_s": delay.clients[PARROT].spread.median,
        "baseline_s": delay.clients[BASELINE].spread.median,
        "parrot_nodelay_s": nodelay.clients[PARROT].spread.median,
        "baseline_nodelay_s": nodelay.clients[BASELINE].spread.median,
        "speedup_delay_submit_criteria": delay.speedup(PARROT_SUBMIT),
        "speedup_nodelay_submit_criteria": nodelay.speedup(PARROT_SUBMIT),
        "total_s": total_s,
    }


# ----------------------------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="short chunks and outputs, 3 repeats (~1 min)")
    parser.add_argument("--json", metavar="PATH", help="write the figures and machine info as JSON")
    add_engine_flags(parser)
    parser.add_argument("--repeats", type=int, help="timed chains per client and setting (median)")
    parser.add_argument("--steps", type=int, help="dependent steps per chain (default 10)")
    parser.add_argument("--chunk-tokens", type=int, help="document tokens added per step")
    parser.add_argument("--max-tokens", type=int, help="output tokens per step")
    return parser.parse_args(argv)


def build_config(args: argparse.Namespace) -> BenchConfig:
    cfg = QUICK if args.quick else FULL
    overrides = {
        "repeats": args.repeats,
        "steps": args.steps,
        "chunk_tokens": args.chunk_tokens,
        "max_tokens": args.max_tokens,
    }
    return replace(cfg, **{k: v for k, v in overrides.items() if v is not None})


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    cfg = build_config(args)

    set_threads(args)
    started = time.perf_counter()
    machine = machine_info()
    engine_config = EngineConfig(num_kv_blocks=1024)
    fns = semantic_functions(cfg)
    log(f"starting the server ({args.model}) ...")
    with serve(args.model, engine_config, cfg) as served, httpx.Client(base_url=served.url, timeout=120) as c:
        chunks = document_chunks(served.engine.tokenizer, cfg.steps, cfg.chunk_tokens)
        log(f"verifying outputs and warming up ({cfg.steps} steps) ...")
        verify(served, c, fns, chunks, cfg)
        base = run_baseline(served, c, chunks, cfg.max_tokens).outputs
        prompt_tokens = [
            len(served.engine.tokenizer.encode(render_prompt({"previous": p, "chunk": ch})))
            for p, ch in zip([FIRST_SUMMARY, *base[:-1]], chunks, strict=True)
        ]
        settings = [measure_setting(served, c, fns, chunks, cfg, d, base[-1]) for d in (False, True)]
    total_s = time.perf_counter() - started
    print_report(cfg, args.model, machine, settings, prompt_tokens, total_s)
    if args.json:
        write_json(
            args.json, json_payload(cfg, args.model, engine_config, machine, settings, prompt_tokens, total_s)
        )
    print(result_line(NAME, result_metrics(settings, total_s)))


if __name__ == "__main__":
    main()
