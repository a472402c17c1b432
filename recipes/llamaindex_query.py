"""LlamaIndex on Parrot: index a bundled public-domain text, then ask it a question with tree_summarize
and refine — each query one DAG submitted to the server.

The index is LlamaIndex's `SummaryIndex` (no embeddings, nothing downloaded) over
``recipes/data/founding_documents.txt``. Both queries go through Parrot's synthesizers: tree_summarize
submits a summary call per packed chunk (a task group) and the reduce call reading their outputs;
refine submits the whole chain, each step's answer feeding the next step's ``existing_answer``. The
server runs the dependent calls back to back and the client gets only the final answer.

Runs with no arguments on the embedded default model (random weights: the answers are gibberish by
design; give ``--server`` a server running a real model for real answers). Prompts are packed for a
1024-token window (``--context-window``) so the short text makes a real tree and chain.

    python recipes/llamaindex_query.py [--server URL] [--question "..."] [--tokenizer PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import parrot as P
from llama_index.core import Document, SummaryIndex
from llama_index.core.node_parser import SentenceSplitter
from llamaindex_parrot import ParrotLLM, get_response_synthesizer, load_tokenizer

TEXT = Path(__file__).resolve().parent / "data" / "founding_documents.txt"
QUESTION = "Which rights does the Bill of Rights protect, and what did Lincoln ask of the living?"


@contextlib.contextmanager
def service(url: str | None) -> Iterator[str]:
    """``url``, or the embedded default server (manager + one engine with the tiny model) started here."""
    if url is not None:
        yield url
        return
    from server import launch

    with launch(model="tiny") as server:
        yield server.url


def tokenizer_for(path: str | None, embedded: bool) -> Callable[[str], list[int]] | None:
    """The engine's tokenizer, so LlamaIndex packs prompts by the server's tokens (None: its default)."""
    if path is not None:
        return load_tokenizer(path)
    if embedded:
        from server.engine.tiny import TOKENIZER_DIR

        return load_tokenizer(TOKENIZER_DIR)
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--server", default=None, help="a running Parrot server (default: start one here)")
    parser.add_argument("--question", default=QUESTION)
    parser.add_argument("--tokenizer", default=None, help="the served model's tokenizer.json")
    parser.add_argument("--context-window", type=int, default=1024, help="tokens to pack prompts for")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens per LLM call")
    args = parser.parse_args()

    tokenizer = tokenizer_for(args.tokenizer, embedded=args.server is None)
    splitter = SentenceSplitter(chunk_size=192, chunk_overlap=0, tokenizer=tokenizer)
    nodes = splitter.get_nodes_from_documents([Document(text=TEXT.read_text())])
    index = SummaryIndex(nodes)
    print(f"indexed {TEXT.name}: {len(nodes)} chunks")

    with service(args.server) as url:
        try:
            llm = ParrotLLM(
                url, max_tokens=args.max_tokens, context_window=args.context_window, tokenizer=tokenizer
            )
        except P.ConnectionError as e:
            raise SystemExit(f"error: {e}") from None
        print(f"model {llm.metadata.model_name} at {url}\nquestion: {args.question}\n")
        for mode in ("tree_summarize", "refine"):
            synthesizer = get_response_synthesizer(llm, mode)
            engine = index.as_query_engine(llm=llm, response_synthesizer=synthesizer)
            started = time.perf_counter()
            response = engine.query(args.question)
            elapsed = time.perf_counter() - started
            print(f"[{mode}] {elapsed:.2f}s, {len(response.source_nodes)} source chunks")
            print(f"answer: {str(response).strip()!r}\n")


if __name__ == "__main__":
    main()
