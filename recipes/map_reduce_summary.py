"""Map-reduce summary with LangChain on Parrot: summarize every chunk in parallel, then combine.

The chain is plain LCEL —

    summarize.map() | RunnableLambda("\\n\\n".join) | combine

with ``summarize`` and ``combine`` each ``prompt | ChatParrot | StrOutputParser``. `compile_chain` turns it
into semantic calls: the map's calls share the system prompt (one prefix context, forked), the join is
template text around their output variables, and the combine call runs as soon as the last summary
exists — the whole job is one submission, and only the final summary comes back to the client.

Here the two halves are compiled separately and queued with ``submit``, so that the progress bar can
follow the map stage as the server finishes it (``build_chain`` is the whole chain in one piece, as the
benchmark runs it). Runs with no arguments on the embedded default model (random weights: gibberish by
design), or against a running server with ``--server URL``. The document is built offline from Python
standard-library docstrings.

    python recipes/map_reduce_summary.py [--server URL] [--chunks 8] [--chunk-words 150]
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Any

if not __package__:  # run as a file: the repository root, not recipes/, comes first on sys.path
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import parrot as P
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.runnables import Runnable, RunnableLambda
from langchain_parrot import ChatFormat, ChatParrot, CompiledChain, compile_chain
from tqdm import tqdm

from recipes.chain_summary import chat_format_dir, make_chunks, service

SYSTEM = (
    "You are an expert technical writer. You write faithful, compact summaries of software documentation "
    "for engineers who have no time to read it. Answer with the summary only."
)
SEPARATOR = "\n\n"


def build_summarize(chat: Runnable[Any, Any]) -> Runnable[str, str]:
    """The map step: one chunk -> its summary."""
    prompt = ChatPromptTemplate.from_messages(
        [("system", SYSTEM), ("human", "Summarize this part of a document:\n\n{chunk}")]
    )
    return prompt | chat | StrOutputParser()


def build_combine(chat: Runnable[Any, Any]) -> Runnable[list[str], str]:
    """The reduce step: the summaries, joined -> one summary."""
    prompt = ChatPromptTemplate.from_messages(
        [("system", SYSTEM), ("human", "Combine these summaries of parts of one document:\n\n{summaries}")]
    )
    return RunnableLambda(SEPARATOR.join) | prompt | chat | StrOutputParser()


def build_chain(map_chat: Runnable[Any, Any], reduce_chat: Runnable[Any, Any]) -> Runnable[list[str], str]:
    """The whole map-reduce: chunks -> summary."""
    return build_summarize(map_chat).map() | build_combine(reduce_chat)


def run_with_progress(summarize: CompiledChain, combine: CompiledChain, url: str, chunks: list[str]) -> str:
    """Queue the map calls and the combine call (one submission), follow the map stage, return the summary."""
    with P.Session(url), tqdm(total=len(chunks) + 1, desc="map-reduce", unit="call") as bar:
        summaries = [summarize.submit(chunk)["output"] for chunk in chunks]
        final = combine.submit(summaries)["output"]
        result: dict[str, Any] = {}

        def wait_final() -> None:  # the wait the job depends on; it also marks the whole DAG latency-critical
            try:
                result["summary"] = final.get(criteria=P.LATENCY)
            except Exception as e:
                result["error"] = e

        waiter = threading.Thread(target=wait_final)
        waiter.start()
        with ThreadPoolExecutor(max_workers=min(8, len(summaries))) as pool:
            for done in as_completed([pool.submit(v.get) for v in summaries]):
                done.result()
                bar.update()
        waiter.join()
        if "error" in result:
            raise result["error"]
        bar.update()
        return str(result["summary"])


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--server", metavar="URL", help="a running Parrot server (default: start one here)")
    parser.add_argument("--model", default="tiny", help="the model name (embedded: 'tiny' or a local folder)")
    parser.add_argument("--model-dir", help="the model's Hugging Face folder, for its chat template")
    parser.add_argument("--chunks", type=int, default=8, help="document parts, summarized in parallel")
    parser.add_argument("--chunk-words", type=int, default=150, help="words per part")
    parser.add_argument("--map-tokens", type=int, default=40, help="tokens per part summary")
    parser.add_argument("--reduce-tokens", type=int, default=64, help="tokens of the final summary")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    started = time.perf_counter()
    chunks = make_chunks(args.chunks, args.chunk_words)
    with service(args.server, args.model) as (url, model):
        chat = ChatParrot(
            base_url=url,
            model=model,
            chat_format=ChatFormat.from_pretrained(chat_format_dir(args.model, args.model_dir)),
        )
        summarize = compile_chain(build_summarize(chat.bind(max_tokens=args.map_tokens)))
        combine = compile_chain(build_combine(chat.bind(max_tokens=args.reduce_tokens)))
        summary = run_with_progress(summarize, combine, url, chunks)
    print(f"\nSummary of {len(chunks)} parts ({args.chunk_words} words each):\n{summary}\n")
    print(f"elapsed: {time.perf_counter() - started:.1f} s (server start included when embedded)")


if __name__ == "__main__":
    try:
        main()
    except P.ParrotError as e:  # server down, slow or refusing: say which and why, without a traceback
        raise SystemExit(f"error: {e}") from None
