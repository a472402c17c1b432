"""A MetaGPT-like multi-agent programming workflow (Fig. 18 of the Parrot paper), as Parrot templates.

A team writes a Python package of ``files`` files. Every agent reads the shared *message pool* — the
project brief (a long constant text: standard-library docstrings standing in for the package's
documentation), the architect's design, and every message posted so far — and posts one message:

* **architect** (1 call): the design of the files and their APIs;
* then ``rounds`` times (3 in the paper):

  - **coders** (``files`` parallel calls): the code of file *i*;
  - **integrator** (1 call): integrates the new code of all files and writes short integration notes;
  - **reviewers** (``files`` parallel calls): review comments on file *i*;
  - **revisers** (``files`` parallel calls): the revised code of file *i*, having read every review;
  - **merger** (1 call): merges the revised files and writes a short changelog.

Calls per job: ``1 + rounds * (3 * files + 2)``. The integrator and the merger are this workload's
addition to the paper's roles: they are where the pool gets the code of all files (MetaGPT's "integration
of the code from all files"), and the final merger's changelog is the job's one final output, the value a
client waits for (the paper's app waits for the final code, which the changelog's prompt contains whole).

The pool is append-only text, so **every prompt starts with the previous pool**, and each pool is exactly the
prompt + output of one earlier call: the architect's (round 1), then the previous round's merger's. Coders
and the integrator continue that context, reviewers and revisers continue the integrator's (prompt + notes)
— which is what Parrot's prefix sharing exploits: a call's prompt that extends a finished call's context
forks it (KV blocks shared, copy-free) and prefills only its own tail. What it cannot share here: the
revisers' common block of all reviews (no finished call ends there; Parrot's manager forks whole cached
contexts, it does not detect shared prefixes at run time between parallel calls), and a context whose
output the whole prompt's tokenization splits differently than the model generated it (then the fork falls
back to a shorter cached context).

DAG shape (what objective deduction sees): the architect, the coders and the integrator of round *r* feed
the integrator / reviewers; the coders of a round feed the integrator together (a **task group**), the
reviewers of a round feed every reviser together (a task group), and the revisers feed the merger together
(a task group). Parallel calls of one stage are independent of each other.

Everything is deterministic: the brief is a piece of `workload_text.stdlib_text` chosen by ``seed``,
the file names are drawn from a fixed list with ``random.Random(seed)``, and the output lengths are fixed
token budgets (greedy, EOS ignored). Prompt lengths grow with the pool: with ``files`` = 8, 3 rounds, a
256-token brief and the default budgets the last prompts are about 3,000 tokens (the tiny model's window is
4,096 positions; `benchmarks.harness.template_dags.longest_request` checks it).
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from parrot.template import parse_template, placeholder_names

from benchmarks.workloads.text import document_chunks, render_template

__all__ = [
    "ARCHITECT",
    "CODER",
    "INTEGRATOR",
    "MERGER",
    "REVIEWER",
    "REVISER",
    "STAGES",
    "Budgets",
    "Call",
    "Workflow",
    "make_workflow",
    "producers",
    "project_brief",
    "stage_roles",
]

ARCHITECT = "architect"
CODER = "coder"
INTEGRATOR = "integrator"
REVIEWER = "reviewer"
REVISER = "reviser"
MERGER = "merger"
STAGES = (CODER, INTEGRATOR, REVIEWER, REVISER, MERGER)  # the stages of one round, in order

# Module names the package's files are drawn from (``seed`` picks and orders them).
FILE_NAMES = (
    "models",
    "views",
    "storage",
    "cli",
    "config",
    "utils",
    "api",
    "parser",
    "cache",
    "auth",
    "events",
    "report",
    "tasks",
    "schema",
    "server",
    "client",
    "search",
    "export",
    "metrics",
    "plugins",
)


@dataclass(frozen=True)
class Budgets:
    """Output tokens of each role's message (greedy, EOS ignored: exactly this many)."""

    design: int = 32
    code: int = 32
    notes: int = 8
    review: int = 12
    changelog: int = 8


@dataclass(frozen=True)
class Call:
    """One agent's LLM call: a Parrot template whose inputs are earlier calls' outputs (by variable name)
    and whose one output is the variable ``output``."""

    output: str  # the output variable's name: also names the call
    role: str
    round: int  # 0-based; -1 for the architect
    template: str
    inputs: tuple[str, ...]  # the template's input names, in order of appearance: earlier calls' outputs
    max_tokens: int


@dataclass(frozen=True)
class Workflow:
    """One job: the brief, the files, and every call in a topological order, grouped into stages (both
    clients run it as a `benchmarks.harness.template_dags.TemplateDag`)."""

    brief: str
    files: tuple[str, ...]
    rounds: int
    calls: tuple[Call, ...]
    stages: tuple[tuple[str, ...], ...]  # outputs of the calls of each stage; a stage's calls are parallel
    final: str  # the output the client waits for (the last merger's changelog)

    def call(self, output: str) -> Call:
        """The call producing ``output``."""
        for c in self.calls:
            if c.output == output:
                return c
        raise KeyError(output)

    def prompt(self, output: str, values: Mapping[str, str]) -> str:
        """The rendered prompt of the call producing ``output`` (what a request-centric client sends, and
        exactly what the Parrot server renders): its template with the input ``values`` in."""
        return render_template(self.call(output).template, values)


def project_brief(tokenizer: Any, tokens: int, seed: int = 0) -> str:
    """The project brief: ``tokens`` tokens of the stdlib text, the ``seed``-th such piece."""
    return document_chunks(tokenizer, seed % 8 + 1, tokens)[seed % 8]


def _var(kind: str, r: int, i: int | None = None) -> str:
    return f"{kind}_r{r}" if i is None else f"{kind}_r{r}_f{i}"


def make_workflow(
    brief: str, files: int, rounds: int = 3, seed: int = 0, budgets: Budgets | None = None
) -> Workflow:
    """The job for ``files`` files and ``rounds`` review rounds over ``brief`` (see the module docstring)."""
    if files < 1 or rounds < 1:
        raise ValueError(f"files and rounds must be >= 1, got {files} and {rounds}")
    if files > len(FILE_NAMES):
        raise ValueError(f"at most {len(FILE_NAMES)} files, got {files}")
    b = budgets or Budgets()
    names = tuple(f"{n}.py" for n in random.Random(seed).sample(FILE_NAMES, files))
    listing = ", ".join(names)
    calls: list[Call] = []
    stages: list[tuple[str, ...]] = []

    def add(output: str, role: str, r: int, template: str, max_tokens: int) -> None:
        inputs = tuple(placeholder_names(parse_template(template), "input"))
        calls.append(Call(output, role, r, template, inputs, max_tokens))

    # The pool so far, as template text; every message ends with a newline so that the next message's
    # text starts a new pre-token (the byte-level tokenizer then splits the prompt where the context ends).
    pool = (
        f"{brief}\n\nThe team writes a Python package of {files} files: {listing}.\n"
        "# architect: the files and their APIs\n"
    )
    add("design", ARCHITECT, -1, pool + "{{output:design}}", b.design)
    stages.append(("design",))
    pool += "{{input:design}}\n"
    for r in range(rounds):
        coders = []
        for i, name in enumerate(names):
            out = _var("code", r, i)
            add(
                out,
                CODER,
                r,
                pool + f"# engineer of {name}, round {r + 1}: code\n{{{{output:{out}}}}}",
                b.code,
            )
            coders.append(out)
        stages.append(tuple(coders))
        code = "".join(f"# {name}\n{{{{input:{c}}}}}\n" for name, c in zip(names, coders, strict=True))
        head = pool + f"# code of round {r + 1}\n" + code + "# integration notes\n"
        notes = _var("notes", r)
        add(notes, INTEGRATOR, r, head + f"{{{{output:{notes}}}}}", b.notes)
        stages.append((notes,))
        pool = head + f"{{{{input:{notes}}}}}\n"
        reviewers = []
        for i, name in enumerate(names):
            out = _var("review", r, i)
            add(out, REVIEWER, r, pool + f"# reviewer of {name}: comments\n{{{{output:{out}}}}}", b.review)
            reviewers.append(out)
        stages.append(tuple(reviewers))
        reviews = "".join(
            f"# review of {name}\n{{{{input:{v}}}}}\n" for name, v in zip(names, reviewers, strict=True)
        )
        pool += reviews
        revisers = []
        for i, name in enumerate(names):
            out = _var("revised", r, i)
            add(out, REVISER, r, pool + f"# engineer of {name}: revised code\n{{{{output:{out}}}}}", b.code)
            revisers.append(out)
        stages.append(tuple(revisers))
        revised = "".join(
            f"# {name}, revised\n{{{{input:{v}}}}}\n" for name, v in zip(names, revisers, strict=True)
        )
        head = pool + revised + f"# changelog of round {r + 1}\n"
        log_var = _var("changelog", r)
        add(log_var, MERGER, r, head + f"{{{{output:{log_var}}}}}", b.changelog)
        stages.append((log_var,))
        pool = head + f"{{{{input:{log_var}}}}}\n"
    return Workflow(brief, names, rounds, tuple(calls), tuple(stages), calls[-1].output)


def stage_roles(workflow: Workflow) -> list[tuple[str, int]]:
    """(role, number of calls) of each stage, in order — the DAG's shape at a glance."""
    return [(workflow.call(stage[0]).role, len(stage)) for stage in workflow.stages]


def producers(workflow: Workflow) -> dict[str, Sequence[str]]:
    """Each call's output -> the outputs its prompt reads (its edges in the DAG)."""
    return {c.output: c.inputs for c in workflow.calls}
