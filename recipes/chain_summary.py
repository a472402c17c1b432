"""Chain (refine) summary with LangChain on Parrot: each step reads the summary so far and the next part.

The refine step is a plain LCEL chain (``prompt | ChatParrot | StrOutputParser``) compiled with
`compile_chain`. A Python loop calls ``compiled.submit(...)`` once per part, passing the previous step's
output *variable* into the next step, so the whole chain of dependent calls is queued without waiting:
the server runs step i+1 as soon as step i is done, with no client round trip in between. The progress
bar follows the steps as the server finishes them; the last summary is fetched once.

The document is the Gettysburg Address (``recipes/data/founding_documents.txt``, public domain), one
refine step per paragraph. Runs with no arguments on the default model (SmolLM2-135M-Instruct,
started here), or against a running server with ``--server URL``.

    python recipes/chain_summary.py [--server URL] [--model NAME] [--max-tokens 80]
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if not __package__:  # run as a file: the repository root, not recipes/, comes first on sys.path
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import parrot as P
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.runnables import Runnable
from langchain_parrot import ChatParrot, CompiledChain, compile_chain
from tqdm import tqdm

from recipes.common import gettysburg_address, service
from workload_text import stdlib_text

SYSTEM = "You summarize documents."
FIRST_SUMMARY = "(nothing yet)"


def make_chunks(count: int, words: int) -> list[str]:
    """``count`` consecutive pieces of ``words`` words of the standard-library docstring text (the
    benchmarks' document, sized at will)."""
    text = stdlib_text(count * words * 8).split()
    return [" ".join(text[i * words : (i + 1) * words]) for i in range(count)]


def build_step(chat: Runnable[Any, Any]) -> Runnable[Any, str]:
    """One refine step: ``{"summary", "chunk"} -> updated summary``."""
    prompt = ChatPromptTemplate.from_messages(
        [
            ("system", SYSTEM),
            (
                "human",
                "Here is a summary of a document so far:\n{summary}\n\nHere is the next part of the "
                "document:\n{chunk}\n\nRewrite the summary so that it also covers the new part. Answer with "
                "the summary only, in at most three sentences.",
            ),
        ]
    )
    return prompt | chat | StrOutputParser()


def submit_chain(compiled: CompiledChain, chunks: list[str]) -> list[P.Variable]:
    """Queue every step in the current session, each reading the previous step's output variable."""
    summary: str | P.Variable = FIRST_SUMMARY
    steps: list[P.Variable] = []
    for chunk in chunks:
        summary = compiled.submit({"summary": summary, "chunk": chunk})["output"]
        steps.append(summary)
    return steps


def run_compiled(
    compiled: CompiledChain, url: str, chunks: list[str], on_step: Callable[[], None] | None = None
) -> str:
    """The chain summary through `compile_chain`: one submission, the last summary fetched once.

    ``on_step`` is called as each step finishes on the server (it fetches the intermediate summaries to
    know, concurrently with the wait for the last one, which stays the only wait the chain depends on).
    """
    with P.Session(url):
        steps = submit_chain(compiled, chunks)
        if on_step is None:
            return str(steps[-1].get(criteria=P.LATENCY))
        final: dict[str, Any] = {}

        def wait_last() -> None:  # marks the chain latency-critical at once, so every step runs
            try:
                final["value"] = steps[-1].get(criteria=P.LATENCY)
            except Exception as e:
                final["error"] = e

        waiter = threading.Thread(target=wait_last)
        waiter.start()
        for step in steps[:-1]:
            step.get()
            on_step()
        waiter.join()
        if "error" in final:
            raise final["error"]
        on_step()
        return str(final["value"])


def run_plain(step: Runnable[Any, str], chunks: list[str], on_step: Callable[[], None] | None = None) -> str:
    """The same chain as plain LangChain: one request per step, each after the previous answer."""
    summary = FIRST_SUMMARY
    for chunk in chunks:
        summary = step.invoke({"summary": summary, "chunk": chunk})
        if on_step is not None:
            on_step()
    return summary


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--server", metavar="URL", help="a running Parrot server (default: start one here)")
    parser.add_argument(
        "--model", help="model name (default: the server's; embedded: smollm2, tiny, a .gguf or a folder)"
    )
    parser.add_argument("--max-tokens", type=int, default=80, help="summary tokens per step")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    started = time.perf_counter()
    parts = gettysburg_address()
    with service(args.server, args.model) as served:
        # No chat_format: the compiled prompts use the chat template the server publishes.
        chat = ChatParrot(base_url=served.url, model=served.model, max_tokens=args.max_tokens)
        compiled = compile_chain(build_step(chat))
        loaded = time.perf_counter()
        with tqdm(total=len(parts), desc="refine steps", unit="step") as bar:
            summary = run_compiled(compiled, served.url, parts, on_step=lambda: bar.update())
        done = time.perf_counter()
    print(f"\nSummary of the Gettysburg Address ({len(parts)} refine steps):\n{summary.strip()}\n")
    print(
        f"elapsed: {done - started:.1f} s ({done - loaded:.1f} s of refine steps; the rest is server start)"
    )


if __name__ == "__main__":
    try:
        main()
    except P.ParrotError as e:  # server down, slow or refusing: say which and why, without a traceback
        raise SystemExit(f"error: {e}") from None
