"""Chain (refine) summary with LangChain on Parrot: each step reads the summary so far and the next chunk.

The refine step is a plain LCEL chain (``prompt | ChatParrot | StrOutputParser``) compiled with
`compile_chain`. A Python loop calls ``compiled.submit(...)`` once per chunk, passing the previous step's
output *variable* into the next step, so the whole chain of dependent calls is queued without waiting:
the server runs step i+1 as soon as step i is done, with no client round trip in between. The progress
bar follows the steps as the server finishes them; the last summary is fetched once.

Runs with no arguments on the embedded default model (random weights: the summary is gibberish by design;
``--model-dir`` and ``--model`` point at a real one), or against a running server with ``--server URL``.
The document is built offline from Python standard-library docstrings.

    python recipes/chain_summary.py [--server URL] [--chunks 6] [--chunk-words 120] [--max-tokens 48]
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

if not __package__:  # run as a file: the repository root, not recipes/, comes first on sys.path
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import parrot as P
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.runnables import Runnable
from langchain_parrot import TINY_MODEL_DIR, ChatFormat, ChatParrot, CompiledChain, compile_chain
from tqdm import tqdm

from benchmarks.common import stdlib_text

SYSTEM = (
    "You are an expert technical writer. You summarize long documents one part at a time, keeping every "
    "important fact and dropping repetition. Answer with the summary only."
)
FIRST_SUMMARY = "(nothing yet)"


def make_chunks(count: int, words: int) -> list[str]:
    """``count`` consecutive pieces of ``words`` words of the standard-library docstring text."""
    text = stdlib_text(count * words * 8).split()
    return [" ".join(text[i * words : (i + 1) * words]) for i in range(count)]


def build_step(chat: Runnable[Any, Any]) -> Runnable[Any, str]:
    """One refine step: ``{"summary", "chunk"} -> updated summary``."""
    prompt = ChatPromptTemplate.from_messages(
        [
            ("system", SYSTEM),
            (
                "human",
                "Summary of the document so far:\n{summary}\n\nNext part of the document:\n{chunk}\n\n"
                "Write the updated summary.",
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


@contextlib.contextmanager
def service(url: str | None, model: str) -> Iterator[tuple[str, str]]:
    """The server to use and the served model's name: ``url``, or an embedded server started here."""
    if url is not None:
        yield url.rstrip("/"), model
        return
    from server import launch

    with launch(model=model) as server:
        yield server.url, server.engines[0].model_name


def chat_format_dir(model: str, model_dir: str | None) -> Path:
    """Where the model's chat template is: ``--model-dir``, the ``--model`` folder, or the tiny model's."""
    if model_dir is not None:
        return Path(model_dir)
    return Path(model) if Path(model).is_dir() else TINY_MODEL_DIR


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--server", metavar="URL", help="a running Parrot server (default: start one here)")
    parser.add_argument("--model", default="tiny", help="the model name (embedded: 'tiny' or a local folder)")
    parser.add_argument("--model-dir", help="the model's Hugging Face folder, for its chat template")
    parser.add_argument("--chunks", type=int, default=6, help="document parts, one refine step each")
    parser.add_argument("--chunk-words", type=int, default=120, help="words per part")
    parser.add_argument("--max-tokens", type=int, default=48, help="summary tokens per step")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    started = time.perf_counter()
    chunks = make_chunks(args.chunks, args.chunk_words)
    with service(args.server, args.model) as (url, model):
        chat = ChatParrot(
            base_url=url,
            model=model,
            max_tokens=args.max_tokens,
            chat_format=ChatFormat.from_pretrained(chat_format_dir(args.model, args.model_dir)),
        )
        compiled = compile_chain(build_step(chat))
        with tqdm(total=len(chunks), desc="refine steps", unit="step") as bar:
            summary = run_compiled(compiled, url, chunks, on_step=lambda: bar.update())
    print(f"\nSummary of {len(chunks)} parts ({args.chunk_words} words each):\n{summary}\n")
    print(f"elapsed: {time.perf_counter() - started:.1f} s (server start included when embedded)")


if __name__ == "__main__":
    try:
        main()
    except P.ParrotError as e:  # server down, slow or refusing: say which and why, without a traceback
        raise SystemExit(f"error: {e}") from None
