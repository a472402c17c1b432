"""Chain summary under load (the Parrot paper's Fig. 11, 12 and 13): Parrot vs a request-centric baseline.

The app is `benchmarks.chain_dependent`'s chain summary (`benchmarks.workloads.summary_chain`: step *i* reads
the summary of step *i - 1* plus document chunk *i*; greedy, EOS ignored) with its two main clients:
**parrot** (every step queued in one session, one ``aget`` of the last summary) and **baseline** (render,
``POST /v1/completions``, wait: one client round trip per step). One server and engine serve the whole run;
the engine admits requests FIFO under a running-token cap (``--max-running-tokens``, the request-centric
latency cap): a lone chain never reaches it, the background load and concurrent apps do, so a request arriving
at a busy engine waits behind earlier ones — the same queue for both clients. Every measurement has the client
network delay on (U(0.2, 0.3) s per request, the paper's 200-300 ms). Four sweeps:

1. **Output length** (Fig. 11a): summary tokens per step, at a fixed chunk size.
2. **Chunk size** (Fig. 11b): document tokens per step, at a fixed output length.
3. **Background load** (Fig. 12a): the chain at the fixed point while ``K`` other requests are kept in
   flight (`harness.chains.BackgroundLoad`) through the whole measurement of both clients.
4. **Concurrent apps** (Fig. 12b, 13): ``A`` chains over their own parts of the document, started together
   (`harness.chains.together`); per client the mean and p90 latency over the apps, and per app the
   baseline's latency minus Parrot's (Fig. 13: in the paper every app finishes earlier with Parrot).

Every step's output is checked equal between the clients before timing; medians over ``--repeats``
interleaved runs after an untimed one that gives the expected summaries, ± half the range. Speedup =
baseline median latency / Parrot's (apps: of the mean latency per app).

    python -m benchmarks.chain_summary [--quick | --tiny] [--json PATH] [--plot PATH] [--steps N]
        [--outs 16,32,64] [--chunks 64,128,256] [--background 4,8] [--apps 4,8]   (``--apps ""``: skip)

Last line: ``RESULT chain_summary speedup_min=... speedup_max=... speedup_out<N>=... speedup_chunk<N>=...
speedup_bg<K>=... speedup_apps<A>=... speedup_apps<A>_p90=... total_s=...`` (min, max: over the others).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from benchmarks.harness import chains, payload_plots, point_sweeps, record, systems
from benchmarks.harness.app_jobs import ChainClient, summary_chain, summary_chains, verify_summary_chain
from benchmarks.harness.measure import Samples
from benchmarks.harness.output import log
from benchmarks.plotting import pyplot, save
from benchmarks.workloads.summary_chain import TEMPLATE
from benchmarks.workloads.text import document_chunks
from server.engine import EngineConfig

NAME = "chain_summary"
SERVER, PARROT, BASELINE = "server", "parrot", "baseline"  # one server, the baseline's configuration
CLIENTS = {PARROT: ChainClient(parrot=True), BASELINE: ChainClient(parrot=False)}  # how each runs a chain
# The background client's prompt (plain requests of other users of the service: no Parrot template).
BACKGROUND_INSTRUCTION = "Summarize the following text.\n\n"
PAPER_ANCHORS: dict[str, Any] = {  # OSDI'24 §8.2: one A100, LLaMA 13B, documents of 20k+ tokens
    "fig11a_output_length": {"vs_vllm_max": 1.38, "vs_huggingface_max": 1.88},
    "fig11b_chunk_size": {"vs_vllm": 1.2, "vs_huggingface": 1.66},
    "fig12a_background": {"vs_vllm": 2.38},
    "fig12b_apps_mean": {"vs_vllm": 1.68},
    "fig13_apps": "25 concurrent apps: every app finishes earlier with Parrot",
}
# Per sweep (its RESULT keys are ``speedup_<sweep><value>``): the paper's figure, a point's value in words.
SWEEPS = {
    "out": ("11a output length", "{} tokens"),
    "chunk": ("11b chunk size", "{} tokens"),
    "bg": ("12a background", "{} in flight"),
    "apps": ("12b/13 apps", "{} apps"),
}


@dataclass(frozen=True)
class SummaryConfig:
    steps: int = 10
    repeats: int = 3
    outs: tuple[int, ...] = (16, 32, 64)  # 11a: output tokens per step, at `fixed_chunk`
    chunks: tuple[int, ...] = (64, 128, 256)  # 11b: document tokens per step, at `fixed_out`
    fixed_out: int = 32
    fixed_chunk: int = 128
    background: tuple[int, ...] = (4, 8)  # 12a: background requests kept in flight
    apps: tuple[int, ...] = (4, 8)  # 12b / 13: concurrent chain-summary apps
    background_prompt_tokens: int = 256
    background_max_tokens: int = 64
    # The engine's FIFO running-token cap: above a lone chain's step, below the background load's.
    max_running_tokens: int = 1024
    num_kv_blocks: int = 2048
    seed: int = 0

    def chain_points(self) -> list[tuple[int, int]]:
        """Every (output tokens, chunk tokens) of sweeps 1 and 2, each once (the fixed point is in both)."""
        points = [(o, self.fixed_chunk) for o in self.outs] + [(self.fixed_out, c) for c in self.chunks]
        return list(dict.fromkeys(points))


FULL = SummaryConfig()
QUICK = SummaryConfig(5, 2, (8, 16), (32, 64), 8, 32, (4,), (2, 4), 128, 32, 512)  # fields in order
TINY = replace(QUICK, steps=2, repeats=1, outs=(8,), chunks=(32,), background=(2,), apps=(2,))
TINY = replace(TINY, background_max_tokens=8)


class Point(point_sweeps.Point):
    """One point of a sweep, both clients measured (apps: with `chains.together`)."""

    sweeps, slow, fast = SWEEPS, BASELINE, PARROT

    def as_dict(self) -> dict[str, Any]:
        out = self.base_dict()
        if self.together:  # apps
            for name, client in out["clients"].items():
                client["per_app_median"] = chains.per_job_median(self.samples[name])
            diff = self.per_job_difference()  # Fig. 13: per app, baseline - Parrot (> 0: Parrot first)
            out |= {"speedup_p90": self.speedup_p90, "per_app_difference_s": diff}
            out["apps_faster_in_parrot"] = sum(d > 0 for d in diff)
        return out


# ----------------------------------------------------------------------------------------------- runs
async def chain(served: systems.Served, cfg: SummaryConfig, out: int, chunk: int) -> dict[str, Samples]:
    """Both clients' chains at ``out`` output and ``chunk`` document tokens per step."""
    chunks = document_chunks(served.tokenizer, cfg.steps, chunk)
    jobs = summary_chains(served, CLIENTS, chunks, out)
    label = f"chain, {out} output and {chunk} chunk tokens: "
    return await chains.delayed_repeats(served, jobs, cfg.repeats, label)


async def with_background(served: systems.Served, cfg: SummaryConfig, in_flight: int) -> Point:
    """The fixed-point chain while ``in_flight`` other requests are outstanding throughout."""
    texts = document_chunks(served.tokenizer, in_flight, cfg.background_prompt_tokens)
    send = chains.completions(served, [BACKGROUND_INSTRUCTION + t for t in texts], cfg.background_max_tokens)
    async with chains.BackgroundLoad(send, in_flight) as load:
        samples = await chain(served, cfg, cfg.fixed_out, cfg.fixed_chunk)
    return Point("bg", in_flight, samples, load.counts())


async def concurrent_apps(served: systems.Served, cfg: SummaryConfig, apps: int) -> Point:
    """``apps`` fixed-point chains over different parts of the document, started together."""
    text = document_chunks(served.tokenizer, apps * cfg.steps, cfg.fixed_chunk)
    parts = [text[a * cfg.steps : (a + 1) * cfg.steps] for a in range(apps)]

    def run(client: ChainClient) -> Any:
        return chains.together(served, [summary_chain(served, client, p, cfg.fixed_out) for p in parts])

    jobs = {name: functools.partial(run, client) for name, client in CLIENTS.items()}
    label = f"{apps} concurrent apps: "
    return Point("apps", apps, await chains.delayed_repeats(served, jobs, cfg.repeats, label))


async def run_all(served: systems.Served, cfg: SummaryConfig) -> tuple[int, list[Point]]:
    """Outputs checked at the fixed point, then every sweep in order: the steps checked, the points."""
    async with systems.connected({SERVER: served}):
        log(f"verifying outputs and warming up ({cfg.steps} steps) ...")
        chunks = document_chunks(served.tokenizer, cfg.steps, cfg.fixed_chunk)
        verified = len(await verify_summary_chain(served, chunks, cfg.fixed_out))
        by_size = {(o, c): await chain(served, cfg, o, c) for o, c in cfg.chain_points()}
        points = [Point("out", o, by_size[o, cfg.fixed_chunk]) for o in cfg.outs]
        points += [Point("chunk", c, by_size[cfg.fixed_out, c]) for c in cfg.chunks]
        points += [await with_background(served, cfg, k) for k in cfg.background]
        points += [await concurrent_apps(served, cfg, a) for a in cfg.apps]
    return verified, points


# ----------------------------------------------------------------------------------------------- report
def table(points: list[Point]) -> str:
    """One row per point (apps: the mean and the p90): both clients' median latency and the speedup."""
    return point_sweeps.table(points, tuple(CLIENTS))


result_metrics = point_sweeps.speedup_metrics  # the headline range of speedups, then each point's


def plot(payload: dict[str, Any], path: Path) -> None:
    """Per sweep each client's median latency with its whisker, and per app of the largest apps point the
    baseline's latency minus Parrot's (Fig. 13)."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 5, figsize=(24, 4.5))
    payload_plots.sweep_bars(axes, payload["sweeps"], tuple(CLIENTS))
    apps = payload["sweeps"]["apps"]["points"]
    diff = apps[-1]["per_app_difference_s"] if apps else []
    axes[4].bar(range(1, len(diff) + 1), diff, color=["tab:green" if d > 0 else "tab:red" for d in diff])
    axes[4].axhline(0, color="black", linewidth=0.8)
    title = f"13: {apps[-1]['label']}, baseline - parrot" if apps else "13: no apps measured"
    axes[4].set(title=title, xlabel="app", ylabel="latency difference (s)", xticks=range(1, len(diff) + 1))
    fig.suptitle(f"chain summary, {payload['model']}, network delay {payload['network_delay_s']} s")
    save(fig, path)


# ----------------------------------------------------------------------------------------------- main
def configure(argv: list[str] | None) -> tuple[argparse.Namespace, SummaryConfig]:
    """The command line and the size it asks for."""
    p = record.parser(
        __doc__,
        "5 steps, short chunks and outputs, 2 repeats (~1.5 min)",
        SummaryConfig,
        repeats="timed runs per client and point (median)",
        steps="dependent steps per chain",
        outs="sweep 1: output tokens per step, e.g. 16,32,64",
        chunks="sweep 2: chunk tokens per step, e.g. 64,128,256",
        background="sweep 3: background requests in flight",
        apps="sweep 4: concurrent apps",
        max_running_tokens="the engine's FIFO running-token cap",
    )
    p.add_argument("--plot", metavar="PATH", help="also draw the figures as a PNG")
    args = p.parse_args(argv)
    return args, record.configured(args, FULL, QUICK, TINY)


def main(argv: list[str] | None = None) -> None:
    args, cfg = configure(argv)
    rec = record.Recorder(NAME, args)
    setup = systems.baseline(
        SERVER, EngineConfig(num_kv_blocks=cfg.num_kv_blocks), cap=cfg.max_running_tokens
    )
    log(f"starting the server ({args.model}) ...")
    with systems.serve(args.model, [setup], seed=cfg.seed) as servers:
        verified, points = asyncio.run(run_all(servers[SERVER], cfg))

    print(rec.header(args.model))
    print(
        f"Chains of {cfg.steps} steps (greedy, EOS ignored), swept around {cfg.fixed_out} output and "
        f"{cfg.fixed_chunk} chunk tokens; delay U{systems.DELAY_S} s per request; one engine, FIFO under "
        f"{cfg.max_running_tokens} running tokens; background requests of {cfg.background_prompt_tokens} + "
        f"{cfg.background_max_tokens} tokens. Median of {cfg.repeats} runs per client, ± half the range; "
        f"every step's output identical between the clients ({verified} steps checked).\n"
    )
    print(table(points) + "\n")
    for p in (p for p in points if p.sweep == "apps"):
        diff = p.per_job_difference()
        faster = f"{sum(d > 0 for d in diff)}/{len(diff)} finish earlier with Parrot"
        print(f"Fig. 13, {p.label}: baseline - Parrot {', '.join(f'{d:+.2f}s' for d in diff)} ({faster})")
    print("paper (A100, LLaMA 13B): " + "; ".join(f"{k} {v}" for k, v in PAPER_ANCHORS.items()))
    sweeps = point_sweeps.by_sweep(points, SWEEPS)
    payload = {"model": args.model, "network_delay_s": list(systems.DELAY_S), "sweeps": sweeps}
    if args.plot:
        plot(payload, Path(args.plot))
    rec.finish(
        result_metrics(points),
        config=cfg,
        systems={SERVER: setup.describe()},
        template=TEMPLATE,
        outputs_identical=True,
        verified_steps=verified,
        paper_anchors=PAPER_ANCHORS,
        **payload,
    )


if __name__ == "__main__":
    main()
