"""Dependent chain: Parrot (submit every call, one ``get``) vs request-centric calls, one server (Fig. 11).

The app (`benchmarks.workloads.summary_chain`): a chain summary of ``steps`` document chunks (stdlib
docstrings); step *i* reads the summary written by step *i - 1* plus chunk *i* and writes the next summary
(greedy, ``max_tokens`` tokens, EOS ignored: every step writes exactly that many). Three clients of one
server and engine (`benchmarks.harness.app_jobs.summary_chain`):

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
from collections.abc import Sequence
from dataclasses import dataclass

from benchmarks.harness import app_jobs, measure, record, systems
from benchmarks.harness.output import log
from benchmarks.harness.record import LatencyRow
from benchmarks.workloads.summary_chain import FIRST_SUMMARY, TEMPLATE, render_prompt
from benchmarks.workloads.text import document_chunks
from server.engine import EngineConfig

NAME = "chain_dependent"
SERVER = "server"  # one server for every client: the baseline's configuration (no OpenAI-route cache)
# The chain's three clients by name: the frontend, the frontend with the criteria at submit, the baseline.
CLIENTS = app_jobs.CHAIN_CLIENTS
PARROT, PARROT_SUBMIT, BASELINE = CLIENTS
PAPER_ANCHOR = (1.38, 1.88)


@dataclass(frozen=True)
class BenchConfig:
    steps: int = 10
    chunk_tokens: int = 128  # new document text per step
    max_tokens: int = 32  # summary tokens written per step
    repeats: int = 5
    seed: int = 0


FULL = BenchConfig()
QUICK = BenchConfig(chunk_tokens=32, max_tokens=8, repeats=2)
TINY = BenchConfig(steps=2, chunk_tokens=8, max_tokens=2, repeats=1)


# ----------------------------------------------------------------------------------------------- runs
async def measure_settings(
    served: systems.Served, chunks: Sequence[str], cfg: BenchConfig
) -> tuple[tuple[str, ...], list[LatencyRow]]:
    """Outputs checked (the warm-up), then ``repeats`` interleaved chains per client without and with the
    network delay; the summaries, and per setting each client's samples and ratio to the baseline."""
    jobs = app_jobs.summary_chains(served, CLIENTS, chunks, cfg.max_tokens)
    settings: list[LatencyRow] = []
    async with systems.connected({SERVER: served}):
        log(f"verifying outputs and warming up ({cfg.steps} steps) ...")
        outputs = await app_jobs.verify_summary_chain(served, chunks, cfg.max_tokens)
        for delay, samples in (await measure.per_delay([served], jobs, cfg.repeats, outputs[-1])).items():
            ratios = {n: measure.ratio(samples[BASELINE], samples[n]) for n in (PARROT, PARROT_SUBMIT)}
            settings.append((systems.delay_label(delay), samples, ratios))
    return outputs, settings


# ----------------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> None:
    args = record.parser(
        __doc__,
        "short chunks and outputs, 2 repeats (~30 s)",
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
