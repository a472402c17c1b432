"""Figure 7 of the Parrot paper: write code, then write tests for it — two LLM calls joined by a variable.

Both calls are submitted at once as unrendered templates; the server runs the second as soon as the first
has produced `code`, with no client round trip in between, and the second prompt continues the first one's
(the task, then the code), so it forks the first call's KV instead of prefilling it again. Runs with no
arguments on the default model (SmolLM2-135M-Instruct, started here); ``--server`` uses a running
`python -m server`.

    python recipes/code_and_tests.py [--task "..."] [--server http://127.0.0.1:9000] [--max-tokens 160]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

if not __package__:  # run as a file: the repository root, not recipes/, comes first on sys.path
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import parrot as P

from recipes.common import service

TASK = "a Python function is_prime(n) that returns True when the integer n is a prime number"


def make_functions(max_tokens: int, model: str | None) -> tuple[P.SemanticFunction, P.SemanticFunction]:
    """The two semantic functions of Figure 7 (``write_code``, ``write_tests``), each writing up to
    ``max_tokens`` tokens with ``model`` (None: the server's default)."""

    # Each answer ends where the model closes its code block.
    @P.semantic_function(max_tokens=max_tokens, model=model, stop="```")
    def write_code(task):
        """You are an expert software engineer. Write the code of {{input:task}}. Answer with the code only.
        Code:
        ```python
        {{output:code}}"""

    @P.semantic_function(max_tokens=max_tokens, model=model, stop="```")
    def write_tests(task, code):
        """You are an expert software engineer. Write the code of {{input:task}}. Answer with the code only.
        Code:
        ```python
        {{input:code}}
        ```
        You are an experienced QA engineer. Write pytest unit tests for the code above.
        Tests:
        ```python
        import pytest


        def test_{{output:tests}}"""

    return write_code, write_tests


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--task", default=TASK)
    parser.add_argument("--server", default=None, help="a running Parrot server (default: start one here)")
    parser.add_argument("--model", default=None, help="model name (default: the server's)")
    parser.add_argument("--max-tokens", type=int, default=160, help="tokens per call")
    args = parser.parse_args()
    started = time.perf_counter()
    with service(args.server, args.model) as served, P.Session(served.url) as session:
        write_code, write_tests = make_functions(args.max_tokens, served.model)
        submitted = time.perf_counter()
        task = session.variable(args.task)
        code = write_code(task)
        tests = write_tests(task, code)
        print(f"task: {args.task}\n\ncode:\n{code.get(criteria=P.LATENCY).strip()}\n")
        # The template starts the first test function (a small model otherwise repeats the code).
        print(f"tests:\ndef test_{tests.get(criteria=P.LATENCY).strip()}\n")
        done = time.perf_counter()
    print(f"elapsed: {done - started:.1f} s, of which the two calls {done - submitted:.1f} s")


if __name__ == "__main__":
    try:
        main()
    except P.ParrotError as e:  # server down, slow or refusing: say which and why, without a traceback
        raise SystemExit(f"error: {e}") from None
