"""LlamaIndex synthesizers: Parrot's DAG submission vs LlamaIndex driving the LLM call by call, one server.

Two LlamaIndex workloads over ``chunks`` document chunks (stdlib docstrings, ``chunk_tokens`` tokens each),
greedy, ``max_tokens`` per call, on the same server and engine:

* **chain** (response mode "refine"): one refine step per chunk, each reading the previous answer.
* **map_reduce** (response mode "tree_summarize"): LlamaIndex packs the chunks for a small window
  (``tree_window`` tokens), summarizes each packed chunk, then reduces the summaries in one call.

Clients, all with the same `ParrotLLM` settings and prompt helper (counting with the engine's tokenizer):

* **parrot** — `ParrotRefine` / `ParrotTreeSummarize`: the whole DAG in one session, one submission and
  one ``get(criteria=latency)``; the session's create and delete are inside the measured time.
* **llamaindex** — LlamaIndex's own `Refine` / `TreeSummarize` (calls one after the other) on
  ``ParrotLLM(unrendered=False)``: one rendered ``/v1/completions`` request per call, waiting for each
  answer — the request-centric baseline.
* **llamaindex async** (map_reduce only) — `TreeSummarize(use_async=True)` ``aget_response``: the map
  requests concurrently, then the reduce.
* **llamaindex + semantic calls** — LlamaIndex's synthesizers on ``ParrotLLM()`` (unrendered): each call a
  semantic call in a session of its own. Left out by ``--quick``.

Every client's answer must equal Parrot's before anything is timed. Latency = one ``get_response``
(``aget_response`` for async); medians over ``--repeats`` interleaved runs after a warm-up, ± half the
range, without and with the client network delay U(0.2, 0.3) s per request. Paper anchors (Fig. 11, 14):
chain summary 1.38x-1.88x, map-reduce 2.37x.

    python -m benchmarks.llamaindex_synth [--quick] [--json PATH] [--model PATH] [--repeats N] [--chunks N]

Last line: ``RESULT llamaindex_synth chain_speedup=... map_reduce_speedup=... map_reduce_speedup_async=...
chain_speedup_nodelay=... map_reduce_speedup_nodelay=... chain_parrot_s=... chain_baseline_s=...
map_reduce_parrot_s=... map_reduce_baseline_s=... total_s=...`` (speedup: the baseline's median latency
over Parrot's, with the delay; ``*_nodelay`` without; ``_async`` against the concurrent baseline).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from llama_index.core.response_synthesizers import BaseSynthesizer, Refine, TreeSummarize
from llamaindex_parrot import ParrotLLM, ParrotRefine, ParrotTreeSummarize

from benchmarks.harness import frameworks, record
from benchmarks.harness.frameworks import Apps, Run
from benchmarks.harness.output import log
from benchmarks.harness.systems import Served
from benchmarks.workloads.text import document_chunks
from server.engine import EngineConfig

NAME = "llamaindex_synth"
QUERY = "What do these parts of the documentation explain?"
PARROT, BASELINE = "parrot", "llamaindex"
BASELINE_ASYNC, SEMANTIC = "llamaindex async", "llamaindex + semantic calls"
CHAIN, MAP_REDUCE = "chain", "map_reduce"
PAPER_ANCHOR = {CHAIN: [1.38, 1.88], MAP_REDUCE: 2.37}


@dataclass(frozen=True)
class BenchConfig:
    chunks: int = 8
    chunk_tokens: int = 128
    max_tokens: int = 32
    refine_window: int = 1024  # every chunk one refine step (LlamaIndex keeps 500 tokens of room)
    tree_window: int = 400  # the chunks pack into several map calls
    repeats: int = 5
    semantic_calls_client: bool = True  # the slowest client; --quick leaves it out
    num_kv_blocks: int = 1024
    seed: int = 0


FULL = BenchConfig()
QUICK = BenchConfig(chunks=6, chunk_tokens=96, max_tokens=16, repeats=2, semantic_calls_client=False)
TINY = BenchConfig(chunks=2, chunk_tokens=16, max_tokens=2, repeats=1)


# ----------------------------------------------------------------------------------------------- clients
def make_llm(served: Served, cfg: BenchConfig, window: int, **options: Any) -> ParrotLLM:
    """A `ParrotLLM` packing for ``window`` tokens, counting with the engine's tokenizer."""
    tokenizer = served.tokenizer

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


def make_apps(served: Served, cfg: BenchConfig, chunks: list[str]) -> Apps:
    """Per workload, each client as a function running one query and returning its answer."""
    chain_llm, tree_llm = make_llm(served, cfg, cfg.refine_window), make_llm(served, cfg, cfg.tree_window)
    chain_rendered = make_llm(served, cfg, cfg.refine_window, unrendered=False)
    tree_rendered = make_llm(served, cfg, cfg.tree_window, unrendered=False)
    chain_helper, tree_helper = chain_llm.prompt_helper(), tree_llm.prompt_helper()

    def sync(synth: BaseSynthesizer) -> Run:
        return lambda: str(synth.get_response(QUERY, chunks))

    def concurrent(synth: BaseSynthesizer) -> Run:
        return lambda: str(asyncio.run(synth.aget_response(QUERY, chunks)))

    apps: dict[str, dict[str, Run]] = {
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
        apps[CHAIN][SEMANTIC] = sync(Refine(llm=chain_llm, prompt_helper=chain_helper))
        apps[MAP_REDUCE][SEMANTIC] = sync(TreeSummarize(llm=tree_llm, prompt_helper=tree_helper))
    return apps


def calls_per_query(served: Served, cfg: BenchConfig, chunks: list[str]) -> dict[str, int]:
    """How many LLM calls each workload makes (LlamaIndex's packing decides; every chunk fits one refine
    step in ``refine_window``)."""
    tree_llm = make_llm(served, cfg, cfg.tree_window)
    summary = TreeSummarize(llm=tree_llm).get_prompts()["summary_template"].partial_format(query_str=QUERY)
    maps = len(tree_llm.prompt_helper().repack(summary, chunks))
    return {CHAIN: len(chunks), MAP_REDUCE: maps + 1 if maps > 1 else 1}


# ----------------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> None:
    args = record.parser(
        __doc__,
        "6 short chunks, 16-token outputs, 2 repeats, fewer clients",
        BenchConfig,
        repeats="timed queries per client, workload and setting",
        chunks="document chunks per query",
        max_tokens="output tokens per call",
    ).parse_args(argv)
    cfg = record.configured(args, FULL, QUICK, TINY)
    rec = record.Recorder(NAME, args)
    log(f"starting the server ({args.model}) ...")
    with frameworks.one_server(args.model, EngineConfig(num_kv_blocks=cfg.num_kv_blocks), cfg.seed) as served:
        chunks = document_chunks(served.tokenizer, cfg.chunks, cfg.chunk_tokens)
        calls = calls_per_query(served, cfg, chunks)
        runs = frameworks.compare(served, make_apps(served, cfg, chunks), cfg.repeats, PARROT)

    print(rec.header(f"{args.model}, 1 engine"))
    print(
        f"{cfg.chunks} chunks of {cfg.chunk_tokens} tokens, {cfg.max_tokens} output tokens per call "
        f"(greedy); chain (refine): {calls[CHAIN]} calls ({cfg.refine_window}-token window); map_reduce "
        f"(tree_summarize): {calls[MAP_REDUCE]} calls ({cfg.tree_window}-token window). Latency of one "
        f"query, median of {cfg.repeats} per client after a warm-up, ± half the range; answers identical "
        "across clients (checked). Requests/job: HTTP requests of one query, session deletes not counted. "
        "Speedup: the client's latency over Parrot's.\n"
    )
    print(frameworks.table(runs) + "\n")
    print("paper anchors (Fig. 11/14): chain summary 1.38x-1.88x, map-reduce 2.37x")

    chain, tree = runs[CHAIN], runs[MAP_REDUCE]
    rec.finish(
        {
            "chain_speedup": chain.speedup(True, BASELINE),
            "map_reduce_speedup": tree.speedup(True, BASELINE),
            "map_reduce_speedup_async": tree.speedup(True, BASELINE_ASYNC),
            "chain_speedup_nodelay": chain.speedup(False, BASELINE),
            "map_reduce_speedup_nodelay": tree.speedup(False, BASELINE),
            "chain_parrot_s": chain.median_s(True, PARROT),
            "chain_baseline_s": chain.median_s(True, BASELINE),
            "map_reduce_parrot_s": tree.median_s(True, PARROT),
            "map_reduce_baseline_s": tree.median_s(True, BASELINE),
        },
        config=cfg,
        model=args.model,
        systems={frameworks.SERVER: served.system.describe()},
        calls_per_query=calls,
        answers_identical=True,
        settings=frameworks.payload(runs),
        paper_anchor=PAPER_ANCHOR,
    )


if __name__ == "__main__":
    main()
