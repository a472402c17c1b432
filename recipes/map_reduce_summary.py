"""Map-reduce summary with LangChain on Parrot: summarize every chunk in parallel, then combine.

The chain is plain LCEL —

    summarize.map() | RunnableLambda("\\n\\n".join) | combine

with ``summarize`` and ``combine`` each ``prompt | ChatParrot | StrOutputParser``. `compile_chain` turns it
into semantic calls: the map's calls share the system prompt (one prefix context, forked), the join is
template text around their output variables, and the combine call runs as soon as the last summary
exists — the whole job is one submission, and only the final summary comes back to the client.

Here the two halves are compiled separately and queued with ``submit``, so that the progress bar can
follow the map stage as the server finishes it (``build_chain`` is the whole chain in one piece, as the
benchmark runs it). The document is the Bill of Rights (``recipes/data/founding_documents.txt``, public
domain): for each of its ten amendments, in parallel, the model says which right it protects, then the ten
sentences become one paragraph. Runs with no arguments on the default model (SmolLM2-135M-Instruct, started
here), or against a running server with ``--server URL``.

    python recipes/map_reduce_summary.py [--server URL] [--model NAME] [--map-tokens 40] [--reduce-tokens 96]
"""

from __future__ import annotations

import argparse
import re
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
from langchain_parrot import ChatParrot, CompiledChain, compile_chain
from tqdm import tqdm

from recipes.common import bill_of_rights, service

SYSTEM = "You answer questions about documents briefly and faithfully."
SEPARATOR = "\n"
MAP_QUESTION = "What right does this text protect? Answer in one short sentence."
REDUCE_QUESTION = "In one short paragraph, say which rights the whole document protects."


def build_summarize(chat: Runnable[Any, Any]) -> Runnable[str, str]:
    """The map step: one part -> a one-sentence answer about it."""
    prompt = ChatPromptTemplate.from_messages([("system", SYSTEM), ("human", "{chunk}\n\n" + MAP_QUESTION)])
    return prompt | chat | StrOutputParser()


def build_combine(chat: Runnable[Any, Any]) -> Runnable[list[str], str]:
    """The reduce step: the answers, joined -> one paragraph."""
    prompt = ChatPromptTemplate.from_messages(
        [
            ("system", SYSTEM),
            (
                "human",
                "These are summaries of the parts of one document:\n\n{summaries}\n\n" + REDUCE_QUESTION,
            ),
        ]
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
    parser.add_argument(
        "--model", help="model name (default: the server's; embedded: smollm2, tiny, a .gguf or a folder)"
    )
    parser.add_argument("--map-tokens", type=int, default=40, help="tokens per part summary")
    parser.add_argument("--reduce-tokens", type=int, default=96, help="tokens of the final summary")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    started = time.perf_counter()
    # Without its "Amendment IV." heading, a small model paraphrases a part instead of copying it.
    parts = [re.sub(r"^Amendment [IVX]+\. ", "", a) for a in bill_of_rights()]
    with service(args.server, args.model) as served:
        # No chat_format: the compiled prompts use the chat template the server publishes.
        chat = ChatParrot(base_url=served.url, model=served.model)
        summarize = compile_chain(build_summarize(chat.bind(max_tokens=args.map_tokens)))
        combine = compile_chain(build_combine(chat.bind(max_tokens=args.reduce_tokens)))
        loaded = time.perf_counter()
        summary = run_with_progress(summarize, combine, served.url, parts)
        done = time.perf_counter()
    print(f"\nSummary of the Bill of Rights ({len(parts)} amendments in parallel):\n{summary.strip()}\n")
    print(f"elapsed: {done - started:.1f} s, of which the map-reduce job {done - loaded:.1f} s")


if __name__ == "__main__":
    try:
        main()
    except P.ParrotError as e:  # server down, slow or refusing: say which and why, without a traceback
        raise SystemExit(f"error: {e}") from None
