"""LlamaIndex synthesizers: Parrot's DAG submission vs LlamaIndex driving the LLM call by call, one server.

Two LlamaIndex workloads over ``chunks`` document chunks (stdlib docstrings, ``chunk_tokens`` tokens each),
greedy, ``max_tokens`` per call, on the same server and engine:

* **chain summary** (response mode "refine"): one refine step per chunk, each reading the previous answer.
* **map-reduce** (response mode "tree_summarize"): LlamaIndex packs the chunks for a small window
  (``tree_window`` tokens), summarizes each packed chunk, then reduces the summaries in one call.

Clients, all with the same `ParrotLLM` settings and prompt helper (counting with the engine's tokenizer):

* **parrot** — `ParrotRefine` / `ParrotTreeSummarize`: the whole DAG in one session, one submission and
  one ``get(criteria=latency)``; the session's create and delete are inside the measured time.
* **llamaindex** — LlamaIndex's own `Refine` / `TreeSummarize` (its defaults: calls one after the other)
  on ``ParrotLLM(unrendered=False)``: the client renders each prompt and sends one ``/v1/completions``
  request per call, waiting for each answer — the request-centric baseline.
* **llamaindex async** (map-reduce only) — `TreeSummarize(use_async=True)` ``aget_response``: the map
  requests concurrently, then the reduce.
* **llamaindex + semantic calls** — LlamaIndex's synthesizers on ``ParrotLLM()`` (unrendered): each call a
  semantic call in a session of its own (session create, submission with get, delete: three requests).
  Left out by ``--quick``.

Before timing, every client's answer is checked to equal Parrot's (greedy on all sides); a difference
stops the run. Latency is the time of one ``get_response`` (``aget_response`` for async), medians over
``--repeats`` runs per client with the clients interleaved, after a warm-up; two settings on the same
server: no network delay, and a simulated client network delay of ``U(0.2, 0.3)`` s per HTTP request
(`server.netdelay.NetworkDelayMiddleware`, the paper's 250 ms).

    python -m benchmarks.llamaindex_synth [--quick] [--json PATH] [--model PATH] [--repeats N]
    (or python benchmarks/llamaindex_synth.py ...)

The last line is ``RESULT llamaindex_synth chain_speedup=... map_reduce_speedup=... ...`` (speedup =
baseline median latency / Parrot's, with the delay; ``*_nodelay`` without it; ``map_reduce_speedup_async``
against the concurrent baseline).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

if not __package__:
    # Run as a file, this script's directory would come first on sys.path (where `benchmarks/kernels.py`
    # shadows the `kernels` package); put the repository root there instead.
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from llama_index.core.response_synthesizers import BaseSynthesizer, Refine, TreeSummarize
from llamaindex_parrot import ParrotLLM, ParrotRefine, ParrotTreeSummarize

from benchmarks.chain_dependent import Served, serve
from benchmarks.common import (
    ClientResult,
    add_engine_flags,
    add_size_flags,
    document_chunks,
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
from server.engine import EngineConfig

NAME = "llamaindex_synth"
QUERY = "What do these parts of the documentation explain?"

PARROT = "parrot"
BASELINE = "llamaindex"
BASELINE_ASYNC = "llamaindex async"
SEMANTIC = "llamaindex + semantic calls"
CHAIN, MAP_REDUCE = "chain summary (refine)", "map-reduce (tree_summarize)"


@dataclass(frozen=True)
class BenchConfig:
    """What one run measures."""

    chunks: int = 8
    chunk_tokens: int = 128
    max_tokens: int = 32
    refine_window: int = 1024  # every chunk one refine step (LlamaIndex keeps 500 tokens of room)
    tree_window: int = 400  # the chunks pack into several map calls
    repeats: int = 5
    semantic_calls_client: bool = True  # the slowest client; --quick leaves it out
    delay_low_s: float = 0.2
    delay_high_s: float = 0.3
    seed: int = 0


FULL = BenchConfig()
QUICK = BenchConfig(chunks=6, chunk_tokens=96, max_tokens=16, repeats=3, semantic_calls_client=False)
TINY = BenchConfig(chunks=2, chunk_tokens=16, max_tokens=2, repeats=1)


# ----------------------------------------------------------------------------------------------- clients
Run = Callable[[], str]


def make_llm(served: Served, cfg: BenchConfig, window: int, **options: Any) -> ParrotLLM:
    """A `ParrotLLM` packing for ``window`` tokens, counting with the engine's tokenizer."""
    tokenizer = served.engine.tokenizer

    def count(text: str) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=False))

    return ParrotLLM(
        served.url,
        model=served.model_name,
        context_window=window,
        max_tokens=cfg.max_tokens,
        tokenizer=count,
        timeout=300,
        **options,
    )


def clients(served: Served, cfg: BenchConfig, chunks: list[str]) -> dict[str, dict[str, Run]]:
    """Per workload, each client as a function running one query and returning its answer."""
    chain_llm, tree_llm = make_llm(served, cfg, cfg.refine_window), make_llm(served, cfg, cfg.tree_window)
    chain_rendered = make_llm(served, cfg, cfg.refine_window, unrendered=False)
    tree_rendered = make_llm(served, cfg, cfg.tree_window, unrendered=False)
    chain_helper, tree_helper = chain_llm.prompt_helper(), tree_llm.prompt_helper()

    def sync(synth: BaseSynthesizer) -> Run:
        return lambda: str(synth.get_response(QUERY, chunks))

    def concurrent(synth: BaseSynthesizer) -> Run:
        return lambda: str(asyncio.run(synth.aget_response(QUERY, chunks)))

    runs = {
        CHAIN: {
            PARROT: sync(ParrotRefine(llm=chain_llm)),
            BASELINE: sync(Refine(llm=chain_rendered, prompt_helper=chain_helper)),
        },
        MAP_REDUCE: {
            PARROT: sync(ParrotTreeSummarize(llm=tree_llm)),
            BASELINE: sync(TreeSummarize(llm=tree_rendered, prompt_helper=tree_helper)),
            BASELINE_ASYNC: concurrent(
                TreeSummarize(llm=tree_rendered, prompt_helper=tree_helper, use_async=True)
            ),
        },
    }
    if cfg.semantic_calls_client:
        runs[CHAIN][SEMANTIC] = sync(Refine(llm=chain_llm, prompt_helper=chain_helper))
        runs[MAP_REDUCE][SEMANTIC] = sync(TreeSummarize(llm=tree_llm, prompt_helper=tree_helper))
    return runs


def calls_per_query(served: Served, cfg: BenchConfig, chunks: list[str]) -> dict[str, int]:
    """How many LLM calls each workload makes (LlamaIndex's packing decides; every chunk fits one refine
    step in ``refine_window``)."""
    tree_llm = make_llm(served, cfg, cfg.tree_window)
    summary = TreeSummarize(llm=tree_llm).get_prompts()["summary_template"].partial_format(query_str=QUERY)
    maps = len(tree_llm.prompt_helper().repack(summary, chunks))
    return {CHAIN: len(chunks), MAP_REDUCE: maps + 1 if maps > 1 else 1}


# ----------------------------------------------------------------------------------------------- measuring
@dataclass
class SettingResult:
    """One workload in one setting (with or without the simulated network delay)."""

    workload: str
    delay: bool
    clients: dict[str, ClientResult]

    def speedup(self, baseline: str) -> float:
        """``baseline``'s median latency over Parrot's."""
        return safe_ratio(self.clients[baseline].spread.median, self.clients[PARROT].spread.median)


def verify(runs: dict[str, dict[str, Run]]) -> dict[str, str]:
    """Every client's answer equal to Parrot's, per workload (untimed; doubles as the warm-up)."""
    answers = {}
    for workload, by_client in runs.items():
        expected = by_client[PARROT]()
        for name, run in by_client.items():
            got = run()
            if got != expected:
                raise SystemExit(f"{workload}: {name} answered {got!r}, parrot {expected!r}")
        answers[workload] = expected
    return answers


def measure(
    served: Served, runs: dict[str, dict[str, Run]], answers: dict[str, str], cfg: BenchConfig, delay: bool
) -> list[SettingResult]:
    """``cfg.repeats`` queries per client and workload, interleaved, rotating which client goes first."""
    served.delay.enabled = delay
    results = []
    try:
        for workload, by_client in runs.items():
            names = list(by_client)
            timings = {name: ClientResult() for name in names}
            for rep in range(cfg.repeats):
                for name in names[rep % len(names) :] + names[: rep % len(names)]:
                    before = served.delay.requests_delayed
                    started = time.perf_counter()
                    answer = by_client[name]()
                    timings[name].seconds.append(time.perf_counter() - started)
                    timings[name].requests.append(served.delay.requests_delayed - before)
                    if answer != answers[workload]:
                        raise SystemExit(f"{workload}: {name}'s answer changed between runs (not greedy?)")
                log(
                    f"  {workload}, {'delay' if delay else 'no delay'}, repeat {rep + 1}: "
                    + " | ".join(f"{n} {r.seconds[-1]:.2f}s" for n, r in timings.items())
                )
            results.append(SettingResult(workload, delay, timings))
    finally:
        served.delay.enabled = False
    return results


# ----------------------------------------------------------------------------------------------- report
def results_table(settings: list[SettingResult]) -> str:
    rows = []
    for st in settings:
        for name, c in st.clients.items():
            s = c.spread
            rows.append(
                [
                    st.workload,
                    "250 ms (0.2-0.3 s)" if st.delay else "none",
                    name,
                    f"{s.median:.3f} ±{s.rel_half_range:.0%}",
                    str(c.requests[0]) if st.delay and c.requests else "",
                    "" if name == PARROT else f"{st.speedup(name):.2f}x",
                ]
            )
    return markdown_table(
        ["workload", "network delay", "client", "latency s (median)", "requests/query", "this / parrot"],
        rows,
        [False, False, False, True, True, True],
    )


def find(settings: list[SettingResult], workload: str, delay: bool) -> SettingResult:
    return next(s for s in settings if s.workload == workload and s.delay == delay)


def result_metrics(settings: list[SettingResult], total_s: float) -> dict[str, float | int]:
    chain, tree = find(settings, CHAIN, True), find(settings, MAP_REDUCE, True)
    return {
        "chain_speedup": chain.speedup(BASELINE),
        "map_reduce_speedup": tree.speedup(BASELINE),
        "map_reduce_speedup_async": tree.speedup(BASELINE_ASYNC),
        "chain_speedup_nodelay": find(settings, CHAIN, False).speedup(BASELINE),
        "map_reduce_speedup_nodelay": find(settings, MAP_REDUCE, False).speedup(BASELINE),
        "chain_parrot_s": chain.clients[PARROT].spread.median,
        "chain_baseline_s": chain.clients[BASELINE].spread.median,
        "map_reduce_parrot_s": tree.clients[PARROT].spread.median,
        "map_reduce_baseline_s": tree.clients[BASELINE].spread.median,
        "total_s": total_s,
    }


def print_report(
    cfg: BenchConfig,
    model: str,
    machine: dict[str, Any],
    settings: list[SettingResult],
    calls: dict[str, int],
) -> None:
    print(
        f"## llamaindex_synth — {model}, {machine['cpu_model']}, {machine['usable_cores']} cores, "
        f"torch {machine['torch']} ({machine['torch_threads']} threads), "
        f"load average {machine['load_average_1m']} at start\n"
    )
    print(
        f"{cfg.chunks} chunks of {cfg.chunk_tokens} tokens, {cfg.max_tokens} output tokens per call "
        f"(greedy); chain: {calls[CHAIN]} calls ({cfg.refine_window}-token window); map-reduce: "
        f"{calls[MAP_REDUCE]} calls ({cfg.tree_window}-token window). Latency of one query, median of "
        f"{cfg.repeats} per client after a warm-up, ± half the range; answers identical across clients "
        "(checked). Requests/query: HTTP requests the client made.\n"
    )
    print(results_table(settings) + "\n")
    print("paper anchors (Fig. 11/12): chain summary 1.38x-1.88x, map-reduce 2.37x")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_size_flags(parser, "6 short chunks, 16-token outputs, 3 repeats, fewer clients")
    add_engine_flags(parser)
    parser.add_argument("--repeats", type=int, help="timed queries per client, workload and setting")
    parser.add_argument("--chunks", type=int, help="document chunks per query")
    parser.add_argument("--max-tokens", type=int, help="output tokens per call")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    cfg = sized(args, FULL, QUICK, TINY, repeats=args.repeats, chunks=args.chunks, max_tokens=args.max_tokens)

    set_threads(args)
    started = time.perf_counter()
    machine = machine_info()
    engine_config = EngineConfig(num_kv_blocks=1024)
    log(f"starting the server ({args.model}) ...")
    # chain_dependent's server setup reads only the delay fields of the config.
    with serve(args.model, engine_config, cfg) as served:  # type: ignore[arg-type]
        chunks = document_chunks(served.engine.tokenizer, cfg.chunks, cfg.chunk_tokens)
        runs = clients(served, cfg, chunks)
        calls = calls_per_query(served, cfg, chunks)
        log("verifying answers and warming up ...")
        answers = verify(runs)
        settings = [s for delay in (False, True) for s in measure(served, runs, answers, cfg, delay)]
    total_s = time.perf_counter() - started
    print_report(cfg, args.model, machine, settings, calls)
    if args.json:
        write_json(
            args.json,
            {
                "benchmark": NAME,
                "config": asdict(cfg),
                "model": args.model,
                "machine": machine,
                "load_average_1m_at_end": load_average(),
                "calls_per_query": calls,
                "answers_identical": True,
                "settings": [
                    {
                        "workload": st.workload,
                        "network_delay": st.delay,
                        "clients": {
                            name: {**asdict(c), "latency": c.spread.as_dict()}
                            for name, c in st.clients.items()
                        },
                        "speedups": {name: st.speedup(name) for name in st.clients if name != PARROT},
                    }
                    for st in settings
                ],
                "paper_anchor": {"chain": [1.38, 1.88], "map_reduce": 2.37},
                "total_s": total_s,
            },
        )
    print(result_line(NAME, result_metrics(settings, total_s)))


if __name__ == "__main__":
    main()
