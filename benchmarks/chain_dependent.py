"""Dependent chain: Parrot (submit every call, one ``get``) vs request-centric calls, one server (Fig. 11).

The app: a chain summary of ``steps`` document chunks (stdlib docstrings); step *i* reads the summary
written by step *i - 1* plus chunk *i* and writes the next summary (greedy, ``max_tokens`` tokens, EOS
ignored: every step writes exactly that many). Three clients of one server and engine:

* **parrot** — the `parrot` frontend: every step queued in one session (each call's input is the previous
  call's output variable), then one ``aget(criteria=P.LATENCY)`` of the last summary: the server runs the
  chain with no client round trip in between.
* **parrot, criteria at submit** — the same, with ``criteria=P.LATENCY`` on the semantic function: the
  server starts each step as soon as it is submitted and its input exists.
* **baseline** — what a LangChain app does against an OpenAI-style service: render the prompt, ``POST
  /v1/completions``, wait, render the next one.

Every step's output must be identical between the clients (greedy) before anything is timed. Latency =
first request to the last summary in the client's hands (Parrot: session creation included, its
``DELETE`` not); medians over ``--repeats`` interleaved chains after the warm-up, ± half the range,
without and with the client network delay U(0.2, 0.3) s per request. Paper anchor: 1.38x-1.88x (Fig. 11).

    python -m benchmarks.chain_dependent [--quick] [--json PATH] [--model PATH] [--repeats N] [--steps N]

Last line: ``RESULT chain_dependent speedup_delay=... speedup_nodelay=... parrot_s=... baseline_s=...
parrot_nodelay_s=... baseline_nodelay_s=... speedup_delay_submit_criteria=...
speedup_nodelay_submit_criteria=... total_s=...`` (speedup: baseline over Parrot median latency).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import parrot as P

from benchmarks.common import document_chunks, log, render_template
from benchmarks.harness import measure, record, systems
from benchmarks.harness.clients import complete, greedy
from benchmarks.harness.measure import Ratio, Samples
from server.engine import EngineConfig

NAME = "chain_dependent"
SERVER = "server"  # one server for every client: the baseline's configuration (no OpenAI-route cache)
PARROT, PARROT_SUBMIT, BASELINE = "parrot", "parrot, criteria at submit", "baseline"
CLIENTS = (PARROT, PARROT_SUBMIT, BASELINE)
PAPER_ANCHOR = (1.38, 1.88)

TEMPLATE = """You are summarizing a long document one part at a time.
Summary of the document so far: {{input:previous}}
Next part of the document:
{{input:chunk}}
Updated summary of the document so far: {{output:summary}}"""
FIRST_SUMMARY = "(nothing yet)"

Setting = tuple[str, dict[str, Samples], dict[str, Ratio]]


@dataclass(frozen=True)
class BenchConfig:
    steps: int = 10
    chunk_tokens: int = 128  # new document text per step
    max_tokens: int = 32  # summary tokens written per step
    repeats: int = 5
    seed: int = 0


FULL = BenchConfig()
QUICK = BenchConfig(chunk_tokens=32, max_tokens=8, repeats=3)
TINY = BenchConfig(steps=2, chunk_tokens=8, max_tokens=2, repeats=1)


# ----------------------------------------------------------------------------------------------- the app
def render_prompt(previous: str, chunk: str) -> str:
    """The baseline's client-side rendering of a step (exactly what the Parrot server renders)."""
    return render_template(TEMPLATE, {"previous": previous, "chunk": chunk})


async def parrot_chain(
    client: httpx.AsyncClient,
    fn: P.SemanticFunction,
    chunks: Sequence[str],
    *,
    every_step: bool = False,
    on_result: Callable[[], None] | None = None,
) -> list[str]:
    """Every step queued in one session, then one ``aget`` of the last summary (``on_result`` is called
    the moment it is in hand); ``every_step`` then also fetches the other summaries."""
    async with P.Session(str(client.base_url), client=client, timeout=300.0):
        made: list[Any] = []
        previous: Any = FIRST_SUMMARY
        for chunk in chunks:
            previous = fn(previous=previous, chunk=chunk)
            made.append(previous)
        last = await made[-1].aget(criteria=P.LATENCY)
        if on_result is not None:
            on_result()
        earlier = await asyncio.gather(*(v.aget() for v in made[:-1])) if every_step else []
    return [*earlier, last]


async def baseline_chain(
    client: httpx.AsyncClient, chunks: Sequence[str], max_tokens: int, *, model: str | None = None
) -> list[str]:
    """Render, ``POST /v1/completions``, wait, repeat: one client round trip per step."""
    outputs, previous = [], FIRST_SUMMARY
    for chunk in chunks:
        previous = await complete(client, render_prompt(previous, chunk), max_tokens, model=model)
        outputs.append(previous)
    return outputs


def job(
    served: systems.Served, client: str, chunks: Sequence[str], max_tokens: int, every_step: bool = False
) -> measure.Job:
    """``client``'s chain on ``served`` as a harness job. Its output: the last summary, or with
    ``every_step`` every summary (a tuple)."""
    criteria = P.LATENCY if client == PARROT_SUBMIT else None  # the outputs' criteria at submit
    sampling = P.SamplingConfig(**greedy(max_tokens))
    fn = P.SemanticFunction.from_template(TEMPLATE, name="summarize", sampling=sampling, criteria=criteria)

    async def run(done: Callable[[], None]) -> str | tuple[str, ...]:
        if client == BASELINE:
            outputs = await baseline_chain(served.http, chunks, max_tokens, model=served.model_name)
        else:
            outputs = await parrot_chain(served.http, fn, chunks, every_step=every_step, on_result=done)
        return tuple(outputs) if every_step else outputs[-1]

    return run


def timed_jobs(
    served: systems.Served,
    clients: Sequence[str],
    chunks: Sequence[str],
    max_tokens: int,
    every_step: bool = False,
) -> dict[str, Callable[[], Awaitable[measure.Run]]]:
    """Each client's chain on ``served``, timed (`measure.timed`), by client name."""
    jobs = {name: job(served, name, chunks, max_tokens, every_step) for name in clients}
    return {name: functools.partial(measure.timed, served, j) for name, j in jobs.items()}


async def verify(served: systems.Served, chunks: Sequence[str], max_tokens: int) -> tuple[str, ...]:
    """Every step's output equal between the clients (greedy; a difference stops the run): the common
    summaries. Untimed; also every client's warm-up."""
    return await measure.agree(timed_jobs(served, CLIENTS, chunks, max_tokens, every_step=True))


# ----------------------------------------------------------------------------------------------- runs
async def measure_settings(
    served: systems.Served, chunks: Sequence[str], cfg: BenchConfig
) -> tuple[tuple[str, ...], list[Setting]]:
    """Outputs checked (the warm-up), then ``repeats`` interleaved chains per client without and with the
    network delay; the summaries, and per setting each client's samples and ratio to the baseline."""
    jobs = timed_jobs(served, CLIENTS, chunks, cfg.max_tokens)
    settings: list[Setting] = []
    async with systems.connected({SERVER: served}):
        log(f"verifying outputs and warming up ({cfg.steps} steps) ...")
        outputs = await verify(served, chunks, cfg.max_tokens)
        for delay, samples in (await measure.per_delay([served], jobs, cfg.repeats, outputs[-1])).items():
            ratios = {n: measure.ratio(samples[BASELINE], samples[n]) for n in (PARROT, PARROT_SUBMIT)}
            settings.append((systems.delay_label(delay), samples, ratios))
    return outputs, settings


# ----------------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> None:
    args = record.parser(
        __doc__,
        "short chunks and outputs, 3 repeats (~1 min)",
        BenchConfig,
        repeats="timed chains per client and setting (median)",
        steps="dependent steps per chain",
        chunk_tokens="document tokens added per step",
        max_tokens="output tokens per step",
    ).parse_args(argv)
    cfg = record.configured(args, FULL, QUICK, TINY)
    rec = record.Recorder(NAME, args)
    setup = systems.baseline(SERVER, EngineConfig(num_kv_blocks=1024))
    log(f"starting the server ({args.model}) ...")
    with systems.serve(args.model, [setup], seed=cfg.seed) as servers:
        served = servers[SERVER]
        chunks = document_chunks(served.tokenizer, cfg.steps, cfg.chunk_tokens)
        outputs, settings = asyncio.run(measure_settings(served, chunks, cfg))
        prompts = [render_prompt(p, c) for p, c in zip([FIRST_SUMMARY, *outputs[:-1]], chunks, strict=True)]
        prompt_tokens = [len(served.tokenizer.encode(p)) for p in prompts]

    print(rec.header(args.model))
    print(
        f"{cfg.steps} dependent steps (chain summary), chunks of {cfg.chunk_tokens} tokens, {cfg.max_tokens} "
        f"output tokens per step (greedy, EOS ignored), prompts {min(prompt_tokens)}-{max(prompt_tokens)} "
        f"tokens; one chain's latency, median of {cfg.repeats} chains per client after a warm-up, ± half the "
        "range; every step's output identical between the clients (checked). Requests/job: HTTP requests "
        "up to the answer (Parrot: the session's create, then one batch of every call and the get). Engine "
        "columns: medians per chain.\n"
    )
    print(record.latency_table(settings) + "\n")
    print(f"paper anchor (Fig. 11, chain summary): {PAPER_ANCHOR[0]}x-{PAPER_ANCHOR[1]}x")

    (_, nodelay, r_nodelay), (_, delay, r_delay) = settings
    rec.finish(
        {
            "speedup_delay": r_delay[PARROT].median,
            "speedup_nodelay": r_nodelay[PARROT].median,
            "parrot_s": delay[PARROT].spread.median,
            "baseline_s": delay[BASELINE].spread.median,
            "parrot_nodelay_s": nodelay[PARROT].spread.median,
            "baseline_nodelay_s": nodelay[BASELINE].spread.median,
            "speedup_delay_submit_criteria": r_delay[PARROT_SUBMIT].median,
            "speedup_nodelay_submit_criteria": r_nodelay[PARROT_SUBMIT].median,
        },
        config=cfg,
        model=args.model,
        systems={SERVER: setup.describe()},
        template=TEMPLATE,
        prompt_tokens_per_step=prompt_tokens,
        outputs_identical=True,
        settings=[
            record.setting_payload(label != "none", samples, ratios) for label, samples, ratios in settings
        ],
        paper_anchor=list(PAPER_ANCHOR),
    )


if __name__ == "__main__":
    main()
