"""LangChain apps: the two recipes through `compile_chain` vs the same chains on `ChatParrot`, one server.

Two applications, written once as LCEL chains in ``recipes/`` and run two ways on the same server and
engine:

* **map_reduce** (`recipes.map_reduce_summary.build_chain`): ``summarize.map() | "\\n\\n".join | combine``
  over ``map_chunks`` chunks of stdlib docstrings;
* **chain_summary** (`recipes.chain_summary.build_step`): a refine loop over ``chain_steps`` chunks, each
  step reading the previous summary.

Clients:

* **parrot** — `compile_chain`: map_reduce is one ``invoke`` of the compiled chain (one submission, one
  wait); chain_summary queues every step with ``submit`` in one session (each step's input is the
  previous step's output variable) and waits for the last summary once;
* **langchain** — the original chains on `ChatParrot` used request by request, as LangChain runs them
  against any OpenAI-style service: ``.map()`` sends its calls concurrently (LangChain's default thread
  pool), the refine loop waits for each answer before the next request.

Both use the same `ChatParrot` settings (greedy, EOS ignored so every call writes exactly its token
budget). Before timing, the outputs of the two clients are checked to be identical for each app (a
difference stops the run). End-to-end latency of one run is measured from the call to the final summary
in the client's hands (the compiled ``invoke`` deletes its session after that, in the background; the
submit loop's ``with P.Session`` block deletes it before returning, inside the timing). Two settings on one
server: without network delay, and with the simulated client delay of ``U(0.2, 0.3)`` s per HTTP request
(the paper's 250 ms). Medians over ``--repeats`` runs per client, clients interleaved, after a warm-up;
the spread (``±``) is half the range.

    python -m benchmarks.langchain_apps [--quick] [--json PATH] [--repeats N]
    (or python benchmarks/langchain_apps.py ...)

The last line is ``RESULT langchain_apps map_reduce_speedup=... chain_summary_speedup=...
map_reduce_parrot_s=... map_reduce_langchain_s=... chain_summary_parrot_s=... chain_summary_langchain_s=...
...`` (speedup = langchain / parrot median latency with the delay; ``*_nodelay`` without).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

if not __package__:
    # Run as a file, this script's directory would come first on sys.path (where `benchmarks/kernels.py`
    # shadows the `kernels` package); put the repository root there instead.
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from langchain_parrot import TINY_MODEL_DIR, ChatFormat, ChatParrot, compile_chain

from benchmarks.common import (
    ClientResult,
    Spread,
    add_engine_flags,
    add_size_flags,
    load_average,
    log,
    machine_info,
    markdown_table,
    result_line,
    safe_ratio,
    set_threads,
    sized,
    write_json,
)
from recipes import chain_summary, map_reduce_summary
from server.engine import EngineConfig
from server.launcher import LaunchedServer, launch
from server.serve.manager import ManagerConfig

NAME = "langchain_apps"
PARROT = "parrot (compile_chain)"
LANGCHAIN = "langchain (ChatParrot)"
CLIENTS = (PARROT, LANGCHAIN)
APPS = ("map_reduce", "chain_summary")


@dataclass(frozen=True)
class BenchConfig:
    """What one run measures."""

    map_chunks: int = 8
    map_words: int = 120
    map_tokens: int = 24
    reduce_tokens: int = 32
    chain_steps: int = 8
    chain_words: int = 80
    chain_tokens: int = 24
    repeats: int = 5
    delay_low_s: float = 0.2
    delay_high_s: float = 0.3
    seed: int = 0


FULL = BenchConfig()
# The recipes' default job shapes (8 chunks mapped, 6 refine steps), with shorter texts and outputs.
QUICK = BenchConfig(
    map_chunks=8,
    map_words=60,
    map_tokens=8,
    reduce_tokens=8,
    chain_steps=6,
    chain_words=40,
    chain_tokens=8,
    repeats=3,
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


# ----------------------------------------------------------------------------------------------- apps
@dataclass
class App:
    """One application, runnable by either client; ``run(client)`` returns the final summary."""

    name: str
    description: str
    runners: dict[str, Callable[[], str]]


def make_apps(url: str, cfg: BenchConfig) -> list[App]:
    """Both apps, both clients, on the server at ``url``."""
    chat = ChatParrot(
        base_url=url,
        temperature=0,
        ignore_eos=True,  # every call writes exactly its token budget, for both clients
        chat_format=ChatFormat.from_pretrained(TINY_MODEL_DIR),
        timeout=300,
    )
    map_chunks = chain_summary.make_chunks(cfg.map_chunks, cfg.map_words)
    map_reduce = map_reduce_summary.build_chain(
        chat.bind(max_tokens=cfg.map_tokens), chat.bind(max_tokens=cfg.reduce_tokens)
    )
    map_reduce_compiled = compile_chain(map_reduce)
    steps = chain_summary.make_chunks(cfg.chain_steps, cfg.chain_words)
    step = chain_summary.build_step(chat.bind(max_tokens=cfg.chain_tokens))
    step_compiled = compile_chain(step)
    return [
        App(
            "map_reduce",
            f"{cfg.map_chunks} chunks of {cfg.map_words} words, {cfg.map_tokens}-token summaries, "
            f"{cfg.reduce_tokens}-token final summary",
            {
                PARROT: lambda: map_reduce_compiled.invoke(map_chunks),
                LANGCHAIN: lambda: map_reduce.invoke(map_chunks),
            },
        ),
        App(
            "chain_summary",
            f"{cfg.chain_steps} dependent steps, chunks of {cfg.chain_words} words, "
            f"{cfg.chain_tokens} tokens per summary",
            {
                PARROT: lambda: chain_summary.run_compiled(step_compiled, url, steps),
                LANGCHAIN: lambda: chain_summary.run_plain(step, steps),
            },
        ),
    ]


# ----------------------------------------------------------------------------------------------- measuring
@dataclass
class AppResult:
    app: str
    delay: bool
    clients: dict[str, ClientResult]

    def speedup(self) -> float:
        return safe_ratio(self.clients[LANGCHAIN].spread.median, self.clients[PARROT].spread.median)

    def speedup_range(self) -> tuple[float, float]:
        ratios = [
            safe_ratio(b, p)
            for b, p in zip(self.clients[LANGCHAIN].seconds, self.clients[PARROT].seconds, strict=True)
        ]
        s = Spread.of(ratios)
        return s.lo, s.hi


def timed(served: LaunchedServer, run: Callable[[], str]) -> tuple[float, str, int]:
    """Latency, output, and the HTTP requests the run made (the session's background delete excluded)."""
    before = Counter(served.request_counts)
    start = time.perf_counter()
    out = run()
    seconds = time.perf_counter() - start
    made = Counter(served.request_counts) - before
    return seconds, out, sum(n for (method, _), n in made.items() if method != "DELETE")


def verify(apps: list[App]) -> dict[str, str]:
    """Each app's output, identical for both clients (greedy); stops the run otherwise. Also the warm-up."""
    outputs: dict[str, str] = {}
    for app in apps:
        got = {client: app.runners[client]() for client in CLIENTS}
        if got[PARROT] != got[LANGCHAIN]:
            raise SystemExit(
                f"{app.name}: outputs differ\n  parrot: {got[PARROT]!r}\n  langchain: {got[LANGCHAIN]!r}"
            )
        outputs[app.name] = got[PARROT]
    return outputs


def measure(
    served: LaunchedServer, apps: list[App], cfg: BenchConfig, delay: bool, expected: dict[str, str]
) -> list[AppResult]:
    """``cfg.repeats`` runs per app and client, clients interleaved (alternating which goes first)."""
    assert served.network_delay is not None
    served.network_delay.enabled = delay
    results = []
    try:
        for app in apps:
            clients = {name: ClientResult() for name in CLIENTS}
            for rep in range(cfg.repeats):
                for name in CLIENTS if rep % 2 == 0 else CLIENTS[::-1]:
                    seconds, out, requests = timed(served, app.runners[name])
                    if out != expected[app.name]:
                        raise SystemExit(
                            f"{app.name}/{name}: the output changed between runs (not deterministic?)"
                        )
                    clients[name].seconds.append(seconds)
                    clients[name].requests.append(requests)
                log(
                    f"  {app.name} {'delay' if delay else 'no delay'} repeat {rep + 1}: "
                    + " | ".join(f"{n} {c.seconds[-1]:.3f}s" for n, c in clients.items())
                )
            results.append(AppResult(app.name, delay, clients))
    finally:
        served.network_delay.enabled = False
    return results


# ----------------------------------------------------------------------------------------------- report
def results_table(results: list[AppResult]) -> str:
    rows = []
    for r in results:
        lo, hi = r.speedup_range()
        for name in CLIENTS:
            c = r.clients[name]
            s = c.spread
            rows.append(
                [
                    r.app,
                    "250 ms (0.2-0.3 s)" if r.delay else "none",
                    name,
                    f"{s.median:.3f} ±{s.rel_half_range:.0%}",
                    f"{s.lo:.3f}-{s.hi:.3f}",
                    str(c.requests[0]) if c.requests else "",
                    f"{r.speedup():.2f}x ({lo:.2f}-{hi:.2f})" if name == PARROT else "",
                ]
            )
    return markdown_table(
        [
            "app",
            "network delay",
            "client",
            "latency s (median)",
            "range s",
            "requests/run",
            "langchain / parrot",
        ],
        rows,
        [False, False, False, True, True, True, True],
    )


def by(results: list[AppResult], app: str, delay: bool) -> AppResult:
    return next(r for r in results if r.app == app and r.delay == delay)


def result_metrics(results: list[AppResult], total_s: float) -> dict[str, float | int]:
    metrics: dict[str, float | int] = {}
    for app in APPS:
        metrics[f"{app}_speedup"] = by(results, app, True).speedup()
    for app in APPS:
        metrics[f"{app}_speedup_nodelay"] = by(results, app, False).speedup()
    for app in APPS:
        r = by(results, app, True)
        metrics[f"{app}_parrot_s"] = r.clients[PARROT].spread.median
        metrics[f"{app}_langchain_s"] = r.clients[LANGCHAIN].spread.median
    metrics["total_s"] = total_s
    return metrics


def print_report(
    cfg: BenchConfig, machine: dict[str, Any], apps: list[App], results: list[AppResult], total_s: float
) -> None:
    print(
        f"## langchain_apps — tiny, {machine['cpu_model']}, {machine['usable_cores']} cores, torch "
        f"{machine['torch']} ({machine['torch_threads']} threads), load average {machine['load_average_1m']} "
        "at start\n"
    )
    for app in apps:
        print(f"- {app.name}: {app.description}")
    print(
        f"\nEnd-to-end latency of one run, median of {cfg.repeats} runs per client after a warm-up, "
        "± half the range; outputs identical between the clients (checked). Requests/run: HTTP requests "
        "of one run, its session delete not counted (Parrot map_reduce: `invoke` deletes its session in "
        "the background, after the result; Parrot chain_summary: the `with P.Session` block of the submit "
        "loop deletes it at its end, inside the timing).\n"
    )
    print(results_table(results) + "\n")
    print(
        "paper anchors (Fig. 10/11, LangChain apps on A100s): map-reduce up to 2.4x, chain summary "
        f"1.38-1.88x. total {total_s:.0f}s"
    )


def json_payload(
    cfg: BenchConfig, machine: dict[str, Any], apps: list[App], results: list[AppResult], total_s: float
) -> dict[str, Any]:
    return {
        "benchmark": NAME,
        "config": asdict(cfg),
        "model": "tiny",
        "apps": {app.name: app.description for app in apps},
        "machine": machine,
        "load_average_1m_at_end": load_average(),
        "outputs_identical": True,
        "results": [
            {
                "app": r.app,
                "network_delay": r.delay,
                "delay_s": [cfg.delay_low_s, cfg.delay_high_s] if r.delay else None,
                "speedup": r.speedup(),
                "speedup_range": list(r.speedup_range()),
                "clients": {
                    name: {**asdict(c), "latency": c.spread.as_dict()} for name, c in r.clients.items()
                },
            }
            for r in results
        ],
        "total_s": total_s,
    }


# ----------------------------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_engine_flags(parser, model=False)
    add_size_flags(parser, "fewer, shorter chunks and outputs (~1 min)")
    parser.add_argument("--repeats", type=int, help="timed runs per client, app and setting (median)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    cfg = sized(args, FULL, QUICK, TINY, repeats=args.repeats)

    set_threads(args)
    started = time.perf_counter()
    machine = machine_info()
    log("starting the server (tiny) ...")
    with launch(
        "tiny",
        engine_config=EngineConfig(num_kv_blocks=2048),
        manager_config=ManagerConfig(openai_prefix_cache=False),  # baseline: no OpenAI-route cache
        startup_timeout=120,
        network_delay=(cfg.delay_low_s, cfg.delay_high_s),
        network_delay_seed=cfg.seed,
    ) as served:
        assert served.network_delay is not None
        served.network_delay.enabled = False
        apps = make_apps(served.url, cfg)
        log("verifying outputs and warming up ...")
        expected = verify(apps)
        results = [r for delay in (False, True) for r in measure(served, apps, cfg, delay, expected)]
    total_s = time.perf_counter() - started
    print_report(cfg, machine, apps, results, total_s)
    if args.json:
        write_json(args.json, json_payload(cfg, machine, apps, results, total_s))
    print(result_line(NAME, result_metrics(results, total_s)))


if __name__ == "__main__":
    main()
