"""LangChain apps: LCEL chains compiled to one submission vs the same chains on `ChatParrot` call by call.

Two applications, written once as LCEL chains (those of ``recipes/map_reduce_summary.py`` and
``recipes/chain_summary.py``) over chunks of stdlib docstrings, run two ways on one server and engine:

* **map_reduce**: ``summarize.map() | join | combine`` over ``map_chunks`` chunks;
* **chain_summary**: a refine loop over ``chain_steps`` chunks, each step reading the previous summary.

Clients, with the same `ChatParrot` settings (greedy, EOS ignored: every call writes its token budget):

* **parrot (compile_chain)** — map_reduce is one ``invoke`` of the compiled chain (one submission, one
  wait; its session is deleted in the background after the answer); chain_summary queues every step with
  ``submit`` in one session, each step's input the previous step's output variable, and waits for the last
  summary once (the session's delete is timed);
* **langchain (ChatParrot)** — the original chains, as LangChain runs them against any OpenAI-style
  service: ``.map()`` sends its calls concurrently (its thread pool), the refine loop waits for each answer.

The two clients' answers must be identical per app before anything is timed. Latency = the call to the
final summary in the client's hands; medians over ``--repeats`` interleaved runs after a warm-up, ± half
the range, without and with the client network delay U(0.2, 0.3) s per request. Paper anchors (Fig. 11,
14): chain summary 1.38x-1.88x, map-reduce up to 2.37x.

    python -m benchmarks.langchain_apps [--quick] [--json PATH] [--model NAME] [--repeats N]

Last line: ``RESULT langchain_apps map_reduce_speedup=... chain_summary_speedup=... *_speedup_nodelay=...
map_reduce_parrot_s=... map_reduce_langchain_s=... chain_summary_parrot_s=... chain_summary_langchain_s=...
total_s=...`` (speedup: langchain over parrot median latency, with the delay; ``*_nodelay`` without).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import parrot as P
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.runnables import Runnable, RunnableLambda
from langchain_parrot import ChatParrot, CompiledChain, compile_chain

from benchmarks.harness import frameworks, record
from benchmarks.harness.frameworks import Apps
from benchmarks.harness.output import log
from server.engine import EngineConfig
from workload_text import stdlib_text

NAME = "langchain_apps"
PARROT = "parrot (compile_chain)"
LANGCHAIN = "langchain (ChatParrot)"
CLIENTS = (PARROT, LANGCHAIN)
APPS = ("map_reduce", "chain_summary")
PAPER_ANCHOR = {"chain_summary": [1.38, 1.88], "map_reduce": 2.37}

# The recipes' prompts (recipes/ is not part of the wheel: the benchmark keeps its own copy).
MAP_SYSTEM = "You answer questions about documents briefly and faithfully."
MAP_HUMAN = "{chunk}\n\nWhat right does this text protect? Answer in one short sentence."
REDUCE_HUMAN = (
    "These are summaries of the parts of one document:\n\n{summaries}\n\n"
    "In one short paragraph, say which rights the whole document protects."
)
REFINE_SYSTEM = "You summarize documents."
REFINE_HUMAN = (
    "Here is a summary of a document so far:\n{summary}\n\nHere is the next part of the document:\n{chunk}"
    "\n\nRewrite the summary so that it also covers the new part. Answer with the summary only, in at most "
    "three sentences."
)
FIRST_SUMMARY = "(nothing yet)"


@dataclass(frozen=True)
class BenchConfig:
    map_chunks: int = 8
    map_words: int = 120
    map_tokens: int = 24
    reduce_tokens: int = 32
    chain_steps: int = 8
    chain_words: int = 80
    chain_tokens: int = 24
    repeats: int = 5
    num_kv_blocks: int = 2048
    seed: int = 0


FULL = BenchConfig()
# The recipes' job shapes (8 chunks mapped, 6 refine steps), with shorter texts and outputs.
QUICK = BenchConfig(
    map_words=60, map_tokens=8, reduce_tokens=8, chain_steps=6, chain_words=40, chain_tokens=8, repeats=2
)
TINY = BenchConfig(
    map_chunks=2,
    map_words=12,
    map_tokens=2,
    reduce_tokens=2,
    chain_steps=2,
    chain_words=12,
    chain_tokens=2,
    repeats=1,
)


# ----------------------------------------------------------------------------------------------- the apps
def make_chunks(count: int, words: int) -> list[str]:
    """``count`` consecutive pieces of ``words`` words of the stdlib docstring text."""
    text = stdlib_text(count * words * 8).split()
    return [" ".join(text[i * words : (i + 1) * words]) for i in range(count)]


def answer(system: str, human: str, chat: Runnable[Any, Any]) -> Runnable[Any, str]:
    """``prompt | chat | StrOutputParser()`` for a system message and a human message template."""
    return ChatPromptTemplate.from_messages([("system", system), ("human", human)]) | chat | StrOutputParser()


def map_reduce_chain(map_chat: Runnable[Any, Any], reduce_chat: Runnable[Any, Any]) -> Runnable[Any, str]:
    """The recipe's whole map-reduce: chunks -> one summary per chunk (``.map()``), joined -> summary."""
    combine = RunnableLambda("\n".join) | answer(MAP_SYSTEM, REDUCE_HUMAN, reduce_chat)
    return answer(MAP_SYSTEM, MAP_HUMAN, map_chat).map() | combine


def refine_compiled(compiled: CompiledChain, url: str, chunks: Sequence[str]) -> str:
    """The chain summary through `compile_chain`: every step submitted in one session, each reading the
    previous step's output variable; the last summary fetched once."""
    with P.Session(url):
        summary: str | P.Variable = FIRST_SUMMARY
        for chunk in chunks:
            summary = compiled.submit({"summary": summary, "chunk": chunk})["output"]
        assert isinstance(summary, P.Variable)
        return str(summary.get(criteria=P.LATENCY))


def refine_plain(step: Runnable[Any, str], chunks: Sequence[str]) -> str:
    """The same chain as plain LangChain: one request per step, each after the previous answer."""
    summary = FIRST_SUMMARY
    for chunk in chunks:
        summary = step.invoke({"summary": summary, "chunk": chunk})
    return summary


def make_apps(url: str, cfg: BenchConfig) -> Apps:
    """Both apps, both clients, on the server at ``url``."""
    chat = ChatParrot(
        base_url=url,
        temperature=0,
        ignore_eos=True,
        timeout=300,  # no chat_format: the clients render chats with the template the server publishes
    )
    map_chunks = make_chunks(cfg.map_chunks, cfg.map_words)
    map_reduce = map_reduce_chain(
        chat.bind(max_tokens=cfg.map_tokens), chat.bind(max_tokens=cfg.reduce_tokens)
    )
    map_reduce_compiled = compile_chain(map_reduce)
    steps = make_chunks(cfg.chain_steps, cfg.chain_words)
    step = answer(REFINE_SYSTEM, REFINE_HUMAN, chat.bind(max_tokens=cfg.chain_tokens))
    step_compiled = compile_chain(step)
    return {
        "map_reduce": {
            PARROT: lambda: map_reduce_compiled.invoke(map_chunks),
            LANGCHAIN: lambda: map_reduce.invoke(map_chunks),
        },
        "chain_summary": {
            PARROT: lambda: refine_compiled(step_compiled, url, steps),
            LANGCHAIN: lambda: refine_plain(step, steps),
        },
    }


def describe(cfg: BenchConfig) -> dict[str, str]:
    return {
        "map_reduce": f"{cfg.map_chunks} chunks of {cfg.map_words} words, {cfg.map_tokens}-token summaries, "
        f"{cfg.reduce_tokens}-token final summary",
        "chain_summary": f"{cfg.chain_steps} dependent steps, chunks of {cfg.chain_words} words, "
        f"{cfg.chain_tokens} tokens per summary",
    }


# ----------------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> None:
    p = record.parser(
        __doc__,
        "fewer, shorter chunks and outputs (~1 min)",
        BenchConfig,
        repeats="timed runs per client, app and setting (median)",
    )
    args = p.parse_args(argv)
    cfg = record.configured(args, FULL, QUICK, TINY)
    rec = record.Recorder(NAME, args)
    log(f"starting the server ({args.model}) ...")
    with frameworks.one_server(args.model, EngineConfig(num_kv_blocks=cfg.num_kv_blocks), cfg.seed) as served:
        runs = frameworks.compare(served, make_apps(served.url, cfg), cfg.repeats, PARROT)

    print(rec.header(f"{args.model}, 1 engine"))
    for app, description in describe(cfg).items():
        print(f"- {app}: {description}")
    print(
        f"\nLatency of one run, median of {cfg.repeats} runs per client after a warm-up, ± half the range; "
        "answers identical between the clients (checked). Requests/job: HTTP requests of one run up to "
        "the answer, session deletes not counted. Speedup: the client's latency over Parrot's.\n"
    )
    print(frameworks.table(runs) + "\n")
    print("paper anchors (Fig. 11/14, LangChain apps on A100s): chain summary 1.38-1.88x, map-reduce 2.37x")

    rec.finish(
        {
            **{f"{app}_speedup": runs[app].speedup(True, LANGCHAIN) for app in APPS},
            **{f"{app}_speedup_nodelay": runs[app].speedup(False, LANGCHAIN) for app in APPS},
            **{
                f"{app}_{client}_s": runs[app].median_s(True, name)
                for app in APPS
                for client, name in (("parrot", PARROT), ("langchain", LANGCHAIN))
            },
        },
        config=cfg,
        model=args.model,
        systems={frameworks.SERVER: served.system.describe()},
        apps=describe(cfg),
        outputs_identical=True,
        settings=frameworks.payload(runs),
        paper_anchor=PAPER_ANCHOR,
    )


if __name__ == "__main__":
    main()
