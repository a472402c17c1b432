"""Parrot in front of vLLM: applications through OpenAI-compatible backends.

The same vLLM server (its CPU build, ``--vllm-python`` / ``$PARROT_VLLM_PYTHON``, prefix caching on as by
default) serves two clients in one run:

* **parrot** — the `parrot` frontend against a Parrot manager with no engine of its own and the vLLM server
  as its engine (`server.cluster.openai_backend`): token-id prompts, a shared prefix computed once on vLLM
  before the requests that fork from it, the DAG run server-side;
* **baseline** — the request-centric client straight to vLLM: rendered prompts, ``POST /v1/completions``.

Workloads: the shared system prompt (`shared_prompt`'s copilot app, ``batch`` users at once) and map-reduce
(`map_reduce`'s app), as `benchmarks.harness.app_jobs` runs them, without and with the client network delay
U(0.2, 0.3) s per request (added by both clients' HTTP transport). vLLM's prefix cache is emptied before
every timed run, and the prompt tokens it computed in each are read from its ``/metrics``
(``shared_computed_ratio``: baseline over Parrot; 1.0 means vLLM's own prefix cache already shared the
prompt, leaving Parrot only its scheduling); answers are checked identical first (float32, so batching does
not change greedy picks).
Then the prefix-cache hit rate across **two** backends with Parrot's prefix affinity on and off (1 - prompt
tokens computed / prompt tokens sent). Without ``--vllm-python``, Parrot's own ``/v1`` serves as the
backend (the figures then say so).

Last line: ``RESULT vllm_backends shared_speedup=... mapreduce_speedup=... mapreduce_speedup_nodelay=...
shared_computed_ratio=... hit_rate_affinity=... hit_rate_no_affinity=... total_s=...`` (speedups:
baseline over Parrot latency).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from benchmarks.harness import app_jobs, backend_fronts, measure, record, systems
from benchmarks.harness.first_jobs import Compared
from benchmarks.harness.openai_servers import Backend
from benchmarks.harness.output import log
from benchmarks.harness.stats import safe_ratio
from benchmarks.harness.systems import Served, System
from benchmarks.harness.vllm_settings import add_vllm_flags
from benchmarks.workloads.copilot import make_workload
from benchmarks.workloads.map_reduce_app import make_doc

NAME = "vllm_backends"
PARROT, BASELINE = "parrot", "baseline"
MAX_MODEL_LEN = 2048
BACKEND_COMPUTED = "backend_prompt_tokens_computed"  # per timed run, from the backend's /metrics


@dataclass(frozen=True)
class BenchConfig:
    batch: int = 16
    system_tokens: int = 1024
    answer_tokens: int = 16
    chunks: int = 8
    chunk_tokens: int = 192
    summary_tokens: int = 24
    repeats: int = 3
    seed: int = 0


FULL = BenchConfig()
QUICK = BenchConfig(batch=8, chunks=6, repeats=2)
TINY = BenchConfig(
    batch=2, system_tokens=160, answer_tokens=4, chunks=2, chunk_tokens=32, summary_tokens=4, repeats=1
)


async def compare(
    served: dict[str, Served],
    backend: Backend,
    delay: backend_fronts.Delay,
    job: Callable[[Served, bool], measure.Job],
    cfg: BenchConfig,
) -> Compared:
    """Answers checked equal, then interleaved repeats without and with the delay, each from an empty
    prefix cache (vLLM's and the Parrot manager's); ratios to Parrot's time. ``job(served, parrot)``: the
    app's job on ``served`` through the `parrot` frontend (the Parrot front) or the baseline's client
    (straight to vLLM)."""
    front = served[PARROT].server
    assert front is not None

    async def run(s: Served, parrot: bool) -> measure.Run:
        backend.reset_prefix_cache()
        front.run(front.manager.drop_cache())  # the manager's contexts: none is warm on the backend now
        before = backend.computed_prompt_tokens()
        run = await measure.timed(s, job(s, parrot))
        # What the backend prefilled for the job: equal counts mean its prefix cache left Parrot nothing.
        computed = {BACKEND_COMPUTED: int(backend.computed_prompt_tokens() - before)}
        return dataclasses.replace(run, engine={**run.engine, **computed})

    jobs = {name: functools.partial(run, s, name == PARROT) for name, s in served.items()}
    expected = await measure.agree(jobs)
    out = {}
    for on in (False, True):
        delay.on = on
        out[on] = await measure.interleave(jobs, cfg.repeats, expected, "delay " if on else "")
    delay.on = False
    return Compared(PARROT, cold={}, settings=out)


async def timed_apps(args: Any, cfg: BenchConfig, backend: Backend) -> dict[str, Compared]:
    delay = backend_fronts.Delay(cfg.seed)
    with backend_fronts.front(args.model, [backend.url], MAX_MODEL_LEN) as front:
        tokenizer = front.engines[0].tokenizer
        model = front.engines[0].model_name
        served = {
            PARROT: Served(
                System(PARROT), front.url, front.engines, server=front, request_counts=front.request_counts
            ),
            BASELINE: Served(System(BASELINE), backend.url, front.engines),
        }
        async with contextlib.AsyncExitStack() as stack:
            for s in served.values():
                http = httpx.AsyncClient(base_url=s.url, timeout=600, event_hooks={"request": [delay]})
                s.client = await stack.enter_async_context(http)
            workload = make_workload(tokenizer, cfg.system_tokens, cfg.batch, cfg.seed)
            doc = make_doc(tokenizer, cfg.chunks, cfg.chunk_tokens, cfg.summary_tokens, cfg.summary_tokens)
            log(f"shared prompt: {cfg.batch} users, {cfg.system_tokens}-token system prompt ({model}) ...")
            shared = await compare(
                served,
                backend,
                delay,
                lambda s, parrot: app_jobs.copilot_batch(
                    s, workload, cfg.batch, cfg.answer_tokens, parrot=parrot
                ),
                cfg,
            )
            log(f"map-reduce: {cfg.chunks} parts of {cfg.chunk_tokens} tokens ...")
            mapred = await compare(
                served, backend, delay, lambda s, parrot: app_jobs.map_reduce(s, doc, parrot=parrot), cfg
            )
    return {"shared_prompt": shared, "map_reduce": mapred}


async def hit_rates(args: Any, cfg: BenchConfig, pair: list[Backend]) -> dict[str, dict[str, Any]]:
    """The shared-prompt batch across two backends, Parrot's prefix affinity on and off: the share of
    prompt tokens the backends served from their prefix caches, and the requests each got."""
    out = {}
    for affinity in (True, False):
        for b in pair:
            b.reset_prefix_cache()
        before = sum(b.computed_prompt_tokens() for b in pair)
        with backend_fronts.front(args.model, [b.url for b in pair], MAX_MODEL_LEN, affinity) as front:
            workload = make_workload(front.engines[0].tokenizer, cfg.system_tokens, cfg.batch, cfg.seed)
            served = Served(System(PARROT), front.url, front.engines, server=front)
            async with httpx.AsyncClient(base_url=front.url, timeout=600) as http:
                served.client = http
                job = app_jobs.copilot_batch(served, workload, cfg.batch, cfg.answer_tokens, parrot=True)
                await job(lambda: None)
            sent = sum(e.prompt_tokens_sent for e in front.engines)
            requests = [e.requests_sent for e in front.engines]
        computed = sum(b.computed_prompt_tokens() for b in pair) - before
        out["affinity" if affinity else "no_affinity"] = {
            "hit_rate": 1 - safe_ratio(computed, sent),
            "prompt_tokens_sent": sent,
            "prompt_tokens_computed": computed,
            "requests_per_backend": requests,
        }
        log(f"  affinity {'on' if affinity else 'off'}: {out['affinity' if affinity else 'no_affinity']}")
    return out


def main(argv: list[str] | None = None) -> None:
    p = record.parser(
        __doc__, f"{QUICK.batch} users, {QUICK.chunks} map calls, {QUICK.repeats} repeats", BenchConfig
    )
    add_vllm_flags(p)
    args = p.parse_args(argv)
    cfg = record.configured(args, FULL, QUICK, TINY)
    rec = record.Recorder(NAME, args)
    kind = "vLLM " if args.vllm_python else "Parrot's own /v1 (no --vllm-python) "
    with (
        tempfile.TemporaryDirectory(prefix=f"{NAME}-") as tmp,
        backend_fronts.backends(args.model, args.vllm_python, 2, Path(tmp), MAX_MODEL_LEN) as pair,
    ):
        log(f"backends up: {kind}x2 ({args.model}, float32)")
        timed = asyncio.run(timed_apps(args, cfg, pair[0]))
        rates = asyncio.run(hit_rates(args, cfg, pair))
    print(rec.header(f"{args.model} behind {kind}"))
    speedups: dict[str, float] = {}
    for app, runs in timed.items():
        for on, samples in runs.settings.items():
            r = runs.speedups(on)[BASELINE]
            key = f"{'shared' if app == 'shared_prompt' else 'mapreduce'}_speedup{'' if on else '_nodelay'}"
            speedups[key] = r.median
            times = ", ".join(
                f"{n} {s.spread.median:.2f} s ({s.engine_median(BACKEND_COMPUTED):.0f} tokens prefilled)"
                for n, s in samples.items()
            )
            print(f"{app}, delay {systems.delay_label(on)}: {times}: baseline / parrot {r}")
    for name, row in rates.items():
        print(f"two backends, {name}: hit rate {row['hit_rate']:.2f}, requests {row['requests_per_backend']}")
    computed = {
        n: timed["shared_prompt"].settings[False][n].engine_median(BACKEND_COMPUTED)
        for n in (PARROT, BASELINE)
    }
    metrics = {
        **speedups,
        "shared_computed_ratio": safe_ratio(computed[BASELINE], computed[PARROT]),
        "hit_rate_affinity": rates["affinity"]["hit_rate"],
        "hit_rate_no_affinity": rates["no_affinity"]["hit_rate"],
    }
    rec.finish(
        metrics,
        config=cfg,
        model=args.model,
        backend=kind.strip(),
        timed={app: runs.payload()["settings"] for app, runs in timed.items()},
        hit_rates=rates,
    )


if __name__ == "__main__":
    main()
