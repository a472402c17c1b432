"""Output parsers run server-side: a compiled LCEL chain whose `NumberedListOutputParser` parses the
model's real answer (``1. ...`` lines) on the server, so the client receives a Python list.

The chain is ``prompt | ChatParrot | NumberedListOutputParser()``. `compile_chain` turns the parser
into a transform of the call's output variable; each question is submitted as its own call (all at once,
sharing the system prompt's KV), and each ``get`` returns the parsed list — the very list LangChain's parser
gives for the same text. Runs with no arguments on the default model (SmolLM2-135M-Instruct, started here),
or against a running server with ``--server URL``.

    python recipes/list_answers.py [--server URL] [--model NAME] [--max-tokens 48]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

if not __package__:  # run as a file: the repository root, not recipes/, comes first on sys.path
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import parrot as P
from langchain_core.output_parsers import NumberedListOutputParser
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.runnables import Runnable
from langchain_parrot import ChatParrot, compile_chain

from recipes.common import service

SYSTEM = "You answer with a numbered list of short items only, with no other text."
QUESTIONS = [
    "List five colors of the rainbow.",
    "List four animals that live in the ocean.",
    "List three planets of the solar system.",
    "List five fruits.",
]


def build_chain(chat: Runnable[Any, Any]) -> Runnable[dict[str, str], list[str]]:
    """``{"question"} -> list of items``."""
    prompt = ChatPromptTemplate.from_messages([("system", SYSTEM), ("human", "{question}")])
    return prompt | chat | NumberedListOutputParser()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--server", default=None, help="a running Parrot server (default: start one here)")
    parser.add_argument("--model", default=None, help="model name (default: the server's)")
    parser.add_argument("--max-tokens", type=int, default=48, help="tokens per answer")
    args = parser.parse_args()
    started = time.perf_counter()
    with service(args.server, args.model) as served:
        chat = ChatParrot(base_url=served.url, model=served.model, max_tokens=args.max_tokens)
        compiled = compile_chain(build_chain(chat))
        submitted = time.perf_counter()
        with P.Session(served.url):
            answers = [compiled.submit({"question": q})["output"] for q in QUESTIONS]
            lists = [a.get(criteria=P.LATENCY) for a in answers]
        done = time.perf_counter()
    for question, items in zip(QUESTIONS, lists, strict=True):
        print(f"{question}\n  -> {items!r} ({type(items).__name__} of {len(items)}, parsed on the server)")
    print(f"\nelapsed: {done - started:.1f} s, of which the {len(QUESTIONS)} calls {done - submitted:.1f} s")


if __name__ == "__main__":
    try:
        main()
    except P.ParrotError as e:  # server down, slow or refusing: say which and why, without a traceback
        raise SystemExit(f"error: {e}") from None
