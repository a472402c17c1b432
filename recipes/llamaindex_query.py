"""LlamaIndex on Parrot: index a bundled public-domain text, then ask it a question with tree_summarize
and refine — each query one DAG submitted to the server.

The index is LlamaIndex's `SummaryIndex` (no embeddings, nothing downloaded) over
``recipes/data/founding_documents.txt``. Both queries go through Parrot's synthesizers: tree_summarize
submits a summary call per packed chunk (a task group) and the reduce call reading their outputs;
refine submits the whole chain, each step's answer feeding the next step's ``existing_answer``. The
server runs the dependent calls back to back and the client gets only the final answer.

Runs with no arguments on the default model (SmolLM2-135M-Instruct, started here; prompts are packed by
its own tokenizer), or against a running server with ``--server URL``. Prompts are packed for a
1024-token window (``--context-window``) so the short text makes a real tree and chain.

    python recipes/llamaindex_query.py [--server URL] [--model NAME] [--question "..."] [--tokenizer PATH]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if not __package__:  # run as a file: the repository root, not recipes/, comes first on sys.path
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import parrot as P
from parrot.extras import require_extra

try:  # README line 1 installs the server extra only: say which pip command this recipe needs
    require_extra("llama_index.core", "recipes/llamaindex_query.py", "llamaindex")
except ModuleNotFoundError as missing:
    sys.exit(str(missing))

from llama_index.core import Document, SummaryIndex
from llama_index.core.node_parser import SentenceSplitter
from llamaindex_parrot import ParrotLLM, get_response_synthesizer, load_tokenizer

from recipes.common import TEXT, service

QUESTION = "Which rights does the Bill of Rights protect?"


def token_counter(path: str | None, engine_tokenizer: Any) -> Callable[[str], list[int]] | None:
    """The served model's tokenizer as ``text -> ids``, so LlamaIndex packs prompts by the server's tokens:
    ``--tokenizer`` (a tokenizer.json), else the embedded engine's own, else None (LlamaIndex's default)."""
    if path is not None:
        return load_tokenizer(path)
    if engine_tokenizer is not None:
        return lambda text: list(engine_tokenizer.encode(text, add_special_tokens=False))
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--server", default=None, help="a running Parrot server (default: start one here)")
    parser.add_argument("--model", default=None, help="model name (default: the server's)")
    parser.add_argument("--question", default=QUESTION)
    parser.add_argument("--tokenizer", default=None, help="the served model's tokenizer.json")
    parser.add_argument("--context-window", type=int, default=1024, help="tokens to pack prompts for")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per LLM call")
    parser.add_argument(
        "--repetition-penalty",
        type=float,
        default=1.2,
        help="vLLM's repetition penalty (1: off): a 135M model's refine and tree summaries otherwise loop",
    )
    args = parser.parse_args()

    started = time.perf_counter()
    with service(args.server, args.model) as served:
        tokenizer = token_counter(args.tokenizer, served.tokenizer)
        splitter = SentenceSplitter(chunk_size=192, chunk_overlap=0, tokenizer=tokenizer)
        nodes = splitter.get_nodes_from_documents([Document(text=TEXT.read_text())])
        index = SummaryIndex(nodes)
        print(f"indexed {TEXT.name}: {len(nodes)} chunks")
        try:
            llm = ParrotLLM(
                served.url,
                model=served.model,
                max_tokens=args.max_tokens,
                repetition_penalty=args.repetition_penalty,
                context_window=args.context_window,
                tokenizer=tokenizer,
            )
            model_name = llm.metadata.model_name  # the first contact with the server (the class is lazy)
        except P.ConnectionError as e:
            raise SystemExit(f"error: {e}") from None
        print(f"model {model_name} at {served.url}\nquestion: {args.question}\n")
        for mode in ("tree_summarize", "refine"):
            synthesizer = get_response_synthesizer(llm, mode)
            engine = index.as_query_engine(llm=llm, response_synthesizer=synthesizer)
            query_started = time.perf_counter()
            response = engine.query(args.question)
            elapsed = time.perf_counter() - query_started
            print(f"[{mode}] {elapsed:.1f} s, {len(response.source_nodes)} source chunks")
            print(f"answer: {str(response).strip()}\n")
    print(f"elapsed: {time.perf_counter() - started:.1f} s (server start included when embedded)")


if __name__ == "__main__":
    main()
