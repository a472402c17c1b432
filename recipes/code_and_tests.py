"""Figure 7 of the Parrot paper: write code, then write tests for it — two LLM calls joined by a variable.

Both calls are submitted at once as unrendered templates; the server runs the second as soon as the first
has produced `code`, with no client round trip in between, and the shared instruction prefix is a forked
engine context. Runs with no arguments on the embedded default model (random weights: the text is
gibberish by design); pass --url to use a running `python -m server`.

    python recipes/code_and_tests.py [--task "a snake game"] [--url http://127.0.0.1:9000]
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator

import parrot as P


@P.semantic_function(max_tokens=48)
def write_code(task):
    """You are an expert software engineer. Write python code for {{input:task}}.
    Code: {{output:code}}"""


@P.semantic_function(max_tokens=48)
def write_tests(task, code):
    """You are an experienced QA engineer. You write unit tests for the code of {{input:task}}:
    {{input:code}}
    Tests: {{output:tests}}"""


@contextlib.contextmanager
def service(url: str | None) -> Iterator[str]:
    if url is not None:
        yield url
        return
    from server import launch  # the embedded default: manager + one engine with the tiny model

    with launch(model="tiny") as server:
        yield server.url


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--task", default="a snake game")
    parser.add_argument("--url", default=None, help="a running Parrot server (default: start one here)")
    args = parser.parse_args()
    with service(args.url) as url, P.Session(url) as session:
        task = session.variable(args.task)
        code = write_code(task)
        tests = write_tests(task, code)
        print("code:", code.get(criteria=P.LATENCY))
        print("tests:", tests.get(criteria=P.LATENCY))


if __name__ == "__main__":
    main()
