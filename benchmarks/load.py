"""Load and fault tool: many concurrent sessions of short dependent chains, and engines killed under load.

Each session is one user of the `parrot` frontend: it opens a ``P.Session``, submits a 3-call chain (call 2
reads call 1's output variable, call 3 call 2's; greedy, ``--max-tokens`` tokens each, EOS ignored), gets
the three values and closes the session. All ``--sessions`` sessions start at once (one ``asyncio`` task
each, with its own HTTP connections, as separate users have). Reported:

* throughput: sessions/s and calls/s over the load's wall time; p50/p99 latency of one chain (session
  opened to its three values in hand);
* errors by type (the client's exception class, with the HTTP status when there is one) and one example
  message each; **lost variables**: chain values never obtained; **inconsistent** chains: greedy chains of
  the same input that did not all produce the same text (a wrong answer somewhere);
* server RSS (``/proc/<pid>/status``) before the load (after a warm-up wave), its peak during, and after
  the sessions ended, and the growth ``after / before - 1`` in percent; "before" and "after" are read once
  the server has been idle for ``settle_s`` (an idle server returns freed memory to the OS:
  `server.common.malloc_tuning.release_free_memory`; the server started here runs, as ``python -m server``
  does,
  with ``PYTHONMALLOC=malloc``, `server.common.server_env.restart_with_server_env`);
* KV blocks in use on every engine after everything ended (``GET /v1/engines``, with the cluster token)
  and, for a server this tool started, after the manager dropped its prefix cache too — the blocks
  nothing should hold any more: ``kv_blocks_leaked``.

Fairness mode (``--fairness CALLS``, `benchmarks.harness.load_fairness`): a server with two API keys (two
tenants); one tenant's session queues CALLS calls at once, the other's single calls are timed alone and
during that flood (p50s and their ratio), and a kept-alive connection's request latency beside a fresh
connection's.

Fault mode (``--kill-engine-every S``): one of the engines is a remote engine process
(``python -m server.engine --model tiny --manager URL``); every S seconds the tool SIGKILLs it and starts a
new one, which joins again. Lost variables are then the work the kill lost.

The server: by default this tool starts one in a subprocess — ``--engines`` tiny engines (in fault mode,
one of them remote), a random cluster token in ``PARROT_CLUSTER_TOKEN`` — through `server.launch` in a
small host process that also answers this tool's "drop your prefix cache" on its stdin (there is no HTTP
route for that; it is what makes the leak count exact). Or ``--url`` points at a running server:
``--server-pid`` then names its process for RSS, and the cluster token comes from
``--cluster-token-file`` or ``$PARROT_CLUSTER_TOKEN``; leaked blocks cannot be told from cached ones there.

    python -m benchmarks.load [--quick | --tiny] [--json PATH] [--sessions N] [--engines N]
        [--max-tokens N] [--kill-engine-every S] [--url URL --server-pid PID] [--cluster-token-file PATH]
        [--fairness CALLS]

The last line is ``RESULT load sessions=... errors=... p99_s=... rss_growth_pct=... kv_blocks_leaked=...
lost_variables=...`` (plus ``sessions_per_s``, ``calls_per_s``, ``p50_s``, ``engine_kills``).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import secrets
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

if not __package__:
    # Run as a file, this script's directory would come first on sys.path (where `benchmarks/kernels.py`
    # shadows the `kernels` package); put the repository root there instead.
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from benchmarks.harness.flags import add_size_flags, sized
from benchmarks.harness.load_fairness import fairness_table, run_fairness
from benchmarks.harness.load_probes import RssSampler, rss_bytes, settled_blocks, wait_for_engines
from benchmarks.harness.load_report import Report, result_metrics, summarize, table
from benchmarks.harness.load_server import (
    CLUSTER_TOKEN_ENV,
    HostedServer,
    RemoteEngine,
    engine_killer,
    free_port,
    host_server,
)
from benchmarks.harness.load_sessions import run_wave
from benchmarks.harness.machine import machine_info
from benchmarks.harness.output import log, result_line, write_json

NAME = "load"


@dataclass(frozen=True)
class Config:
    """The load's size and pace (`FULL`, `QUICK`, `TINY`; flags override each field)."""

    sessions: int = 1000
    engines: int = 2
    max_tokens: int = 4
    warmup: int = 20  # sessions run (unmeasured) before the "before" RSS: lazy imports, caches, pools
    kill_engine_every: float | None = None
    timeout_s: float = 600.0  # per session: a chain not done by then counts as lost
    settle_s: float = 6.0  # idle seconds before an RSS reading: > 2 ticks of server.http.app.IDLE_CHECK_S


FULL = Config()
QUICK = Config(sessions=200)
TINY = Config(sessions=10, warmup=4)


def run(cfg: Config, url: str | None, server_pid: int | None, token: str) -> Report:
    """Warm up, then the measured wave (with the remote engine killed every ``cfg.kill_engine_every`` s in
    fault mode), then the leaks: RSS before and after at rest, KV blocks after (and after the cache drop).
    ``url`` None: against a server started here (its engines: the remote one in fault mode, local others)."""
    local_engines = cfg.engines - 1 if cfg.kill_engine_every else cfg.engines
    hosted = HostedServer(local_engines, token) if url is None else None
    remote: RemoteEngine | None = None
    try:
        base = url or hosted.url  # type: ignore[union-attr]
        pid = server_pid if hosted is None else hosted.pid
        if hosted is not None and cfg.kill_engine_every:
            remote = RemoteEngine(base, token)
            wait_for_engines(base, token, cfg.engines)
        log(f"warm-up: {cfg.warmup} sessions")
        asyncio.run(run_wave(base, cfg.warmup, max_tokens=cfg.max_tokens, timeout_s=cfg.timeout_s))
        time.sleep(cfg.settle_s)
        before = rss_bytes(pid) if pid else None
        log(f"load: {cfg.sessions} concurrent sessions of 3-call chains")
        with RssSampler(pid) as sampler, engine_killer(remote, cfg.kill_engine_every):
            wave = run_wave(
                base, cfg.sessions, max_tokens=cfg.max_tokens, timeout_s=cfg.timeout_s, first=cfg.warmup
            )
            outcomes, seconds = asyncio.run(wave)
        if remote is not None:  # the last restart must have joined before blocks are counted
            wait_for_engines(base, token, cfg.engines)
        kv_after = settled_blocks(base, token, wait_s=0)
        leaked = math.nan
        if hosted is not None:
            log(f"dropped {hosted.drop_cache()} cached contexts")
            leaked = settled_blocks(base, token)
        time.sleep(cfg.settle_s)
        after = rss_bytes(pid) if pid else None
    finally:
        if remote is not None:
            remote.stop()
        if hosted is not None:
            hosted.close()
    mb = 1 / (1 << 20)
    growth = (after / before - 1) * 100 if before and after else math.nan
    return Report(
        **summarize(outcomes, seconds),
        rss_before_mb=before * mb if before else math.nan,
        rss_peak_mb=max(sampler.peak, after or 0) * mb if pid else math.nan,
        rss_after_mb=after * mb if after else math.nan,
        rss_growth_pct=growth,
        kv_blocks_after=kv_after,
        kv_blocks_leaked=leaked,
        engine_kills=remote.kills if remote is not None else 0,
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line (see the module docstring); contradictory or out-of-range flags are refused."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_size_flags(parser, f"{QUICK.sessions} sessions (~1 min)")
    parser.add_argument("--sessions", type=int, help=f"concurrent sessions (default {FULL.sessions})")
    parser.add_argument(
        "--engines", type=int, help=f"tiny engines of a started server (default {FULL.engines})"
    )
    parser.add_argument("--max-tokens", type=int, help=f"tokens per call (default {FULL.max_tokens})")
    parser.add_argument("--warmup", type=int, help="unmeasured sessions before the load")
    parser.add_argument(
        "--kill-engine-every",
        type=float,
        metavar="S",
        help="SIGKILL and restart a remote engine every S seconds",
    )
    parser.add_argument("--timeout", type=float, help="seconds a session may take before its chain is lost")
    parser.add_argument("--url", help="a running server (default: start one in a subprocess)")
    parser.add_argument("--server-pid", type=int, help="the --url server's process id, for its RSS")
    parser.add_argument(
        "--cluster-token-file", metavar="PATH", help=f"the cluster token (default: ${CLUSTER_TOKEN_ENV})"
    )
    parser.add_argument(
        "--fairness",
        type=int,
        metavar="CALLS",
        help="tenant-fairness mode: one tenant floods CALLS calls, another's call latency is measured",
    )
    parser.add_argument("--host-server", type=int, metavar="PORT", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.kill_engine_every is not None and args.url:
        parser.error("--kill-engine-every needs a server this tool starts (no --url)")
    for name in ("sessions", "engines", "max_tokens"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.kill_engine_every is not None and args.kill_engine_every <= 0:
        parser.error("--kill-engine-every must be positive")
    if args.fairness is not None and (args.fairness < 1 or args.url or args.kill_engine_every):
        parser.error("--fairness needs a positive call count and a server started here (no --url or kills)")
    return args


def build_config(args: argparse.Namespace) -> Config:
    """The size flag's `Config`, with the flags given; fault mode needs a surviving engine."""
    cfg = sized(
        args,
        FULL,
        QUICK,
        TINY,
        sessions=args.sessions,
        engines=args.engines,
        max_tokens=args.max_tokens,
        warmup=args.warmup,
        kill_engine_every=args.kill_engine_every,
        timeout_s=args.timeout,
    )
    if cfg.kill_engine_every and cfg.engines < 2:
        raise SystemExit("--kill-engine-every needs --engines 2 or more (a survivor and the one killed)")
    return cfg


def cluster_token(args: argparse.Namespace) -> str:
    """The cluster token: ``--cluster-token-file``, else the environment's, else (a started server) new."""
    if args.cluster_token_file:
        return Path(args.cluster_token_file).read_text().strip()
    # A started server gets a fresh token; a running one's comes from the environment.
    return os.environ.get(CLUSTER_TOKEN_ENV, "").strip() or (
        secrets.token_urlsafe(32) if not args.url else ""
    )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.host_server is not None:
        host_server(args.host_server, args.engines or FULL.engines)
        return
    if args.fairness is not None:
        fair = run_fairness(args.fairness, free_port())
        print(fairness_table(fair))
        if args.json:
            write_json(args.json, {"report": asdict(fair), "machine": machine_info()})
        print(result_line(f"{NAME}_fairness", asdict(fair)))
        return
    cfg = build_config(args)
    started = time.perf_counter()
    report = run(cfg, args.url, args.server_pid, cluster_token(args))
    print(table(report))
    if args.json:
        write_json(
            args.json,
            {"config": asdict(cfg), "report": asdict(report), "total_s": time.perf_counter() - started,
             "machine": machine_info()},
        )  # fmt: skip
    print(result_line(NAME, result_metrics(report)))


if __name__ == "__main__":
    main()
