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
  `server.malloc_tuning.release_free_memory`; the server started here runs, as ``python -m server`` does,
  with ``PYTHONMALLOC=malloc``, `server.malloc_tuning.restart_with_objects_on_malloc`);
* KV blocks in use on every engine after everything ended (``GET /v1/engines``, with the cluster token)
  and, for a server this tool started, after the manager dropped its prefix cache too — the blocks
  nothing should hold any more: ``kv_blocks_leaked``.

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

The last line is ``RESULT load sessions=... errors=... p99_s=... rss_growth_pct=... kv_blocks_leaked=...
lost_variables=...`` (plus ``sessions_per_s``, ``calls_per_s``, ``p50_s``, ``engine_kills``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

if not __package__:
    # Run as a file, this script's directory would come first on sys.path (where `benchmarks/kernels.py`
    # shadows the `kernels` package); put the repository root there instead.
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import httpx
import parrot as P

from benchmarks.common import (
    add_size_flags,
    fmt_num,
    log,
    machine_info,
    markdown_table,
    percentile,
    result_line,
    sized,
    write_json,
)
from server.malloc_tuning import OBJECTS_ON_MALLOC, PYTHON_ALLOCATOR_ENV

NAME = "load"
CLUSTER_TOKEN_ENV = "PARROT_CLUSTER_TOKEN"  # what `python -m server` and `python -m server.engine` read
# Distinct chain inputs: sessions of the same input must produce the same chain (greedy), which is how a
# wrong answer shows; several inputs keep the prefix cache from making every session one request.
SEEDS = [f"Story {i}: the {w} walked to the river and saw" for i, w in enumerate(["fox", "owl", "cat", "ox"])]
HEARTBEAT_S = 0.5  # the hosted manager's heartbeat check, so a dead remote engine leaves service quickly
START_TIMEOUT_S = 180.0  # importing torch and building engines on a busy 2-core machine


@dataclass(frozen=True)
class Config:
    sessions: int = 1000
    engines: int = 2
    max_tokens: int = 4
    warmup: int = 20  # sessions run (unmeasured) before the "before" RSS: lazy imports, caches, pools
    kill_engine_every: float | None = None
    timeout_s: float = 600.0  # per session: a chain not done by then counts as lost
    settle_s: float = 6.0  # idle seconds before an RSS reading: > 2 ticks of server.app.IDLE_CHECK_S


FULL = Config()
QUICK = Config(sessions=200)
TINY = Config(sessions=10, warmup=4)


# ----------------------------------------------------------------------------------------------- the chain
def chain_step(max_tokens: int) -> P.SemanticFunction:
    return P.SemanticFunction.from_template(
        "Step {{input:n}} of a story. So far: {{input:prev}} Then: {{output:next}}",
        name="load_step",
        sampling=P.SamplingConfig(max_tokens=max_tokens, ignore_eos=True),
    )


@dataclass
class SessionOutcome:
    seed: int
    seconds: float
    values: list[str | None]  # the three chain values; None: lost
    errors: list[str] = field(default_factory=list)  # "Type" or "Type 503", one per failure
    messages: list[str] = field(default_factory=list)


def _error_key(e: BaseException) -> str:
    status = getattr(e, "status", None)
    return f"{type(e).__name__} {status}" if status is not None else type(e).__name__


async def run_session(url: str, index: int, step: P.SemanticFunction, timeout_s: float) -> SessionOutcome:
    """One user: open a session, submit the 3-call chain, get every value, close the session."""
    seed = index % len(SEEDS)
    out = SessionOutcome(seed, math.nan, [None, None, None])
    started = time.perf_counter()
    try:
        # Its own HTTP client, as separate users have: one pool shared by a thousand long-polling sessions
        # spends the client's CPU on the pool's waiting list (quadratic), not on the server.
        async with P.Session(url, timeout=timeout_s, poll_timeout=min(30.0, timeout_s)):
            prev: str | P.Variable = SEEDS[seed]
            chain = []
            for n in range(3):
                prev = step(n=str(n + 1), prev=prev)
                chain.append(prev)
            for i in (2, 0, 1):  # the last first: one get runs the whole chain server-side
                try:
                    out.values[i] = await chain[i].aget(timeout=timeout_s)
                except P.ParrotError as e:
                    out.errors.append(_error_key(e))
                    out.messages.append(str(e))
            out.seconds = time.perf_counter() - started
    except Exception as e:  # opening or closing the session failed: whatever is missing is lost
        out.errors.append(_error_key(e))
        out.messages.append(f"{type(e).__name__}: {e}")
    return out


async def run_wave(
    url: str, cfg: Config, sessions: int, first: int = 0, progress_s: float = 15.0
) -> tuple[list[SessionOutcome], float]:
    """``sessions`` concurrent sessions; returns their outcomes and the wave's wall time."""
    step = chain_step(cfg.max_tokens)
    started = time.perf_counter()
    tasks = [asyncio.create_task(run_session(url, first + i, step, cfg.timeout_s)) for i in range(sessions)]
    pending = set(tasks)
    while pending:
        _, pending = await asyncio.wait(pending, timeout=progress_s)
        if pending:
            elapsed = time.perf_counter() - started
            log(f"  {sessions - len(pending)}/{sessions} sessions done after {elapsed:.0f} s")
    return [t.result() for t in tasks], time.perf_counter() - started


# ----------------------------------------------------------------------------------------------- the server
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rss_bytes(pid: int) -> int | None:
    """Resident set size of ``pid`` from /proc (None if it is gone or this is not Linux)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


class RssSampler:
    """The peak RSS of a process, sampled on a thread while a load runs."""

    def __init__(self, pid: int | None, every_s: float = 0.25) -> None:
        self.pid, self.every_s = pid, every_s
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> RssSampler:
        if self.pid is not None:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.peak = max(self.peak, rss_bytes(self.pid) or 0)  # type: ignore[arg-type]


class HostedServer:
    """The server under test, in a subprocess (``python -m benchmarks.load --host-server``)."""

    def __init__(self, cfg: Config, token: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        local = cfg.engines - 1 if cfg.kill_engine_every else cfg.engines
        # Run as `python -m server` runs (server.malloc_tuning): Python's objects on glibc's heap.
        env = {**os.environ, CLUSTER_TOKEN_ENV: token}
        env.setdefault(PYTHON_ALLOCATOR_ENV, OBJECTS_ON_MALLOC)
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "benchmarks.load",
                "--host-server",
                str(self.port),
                "--engines",
                str(local),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            text=True,
        )
        self.pid = self.proc.pid
        ready = self._read()
        if not ready.get("ready"):
            self.close()
            raise RuntimeError(f"the server did not start: {ready}")

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the server process exited (status {self.proc.wait()})")
        return json.loads(line)

    def drop_cache(self) -> int:
        """Have the manager free every cached context (prefixes, finished steps); returns how many."""
        assert self.proc.stdin is not None
        self.proc.stdin.write("drop_cache\n")
        self.proc.stdin.flush()
        return int(self._read()["dropped"])

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                pipe.close()


def host_server(port: int, engines: int) -> None:
    """The host process: `server.launch` the manager and tiny engines, then serve stdin commands."""
    from server.engine import EngineConfig
    from server.launcher import launch
    from server.serve.manager import ManagerConfig

    config = ManagerConfig(heartbeat_interval=HEARTBEAT_S, engine_timeout=4 * HEARTBEAT_S)
    token = os.environ[CLUSTER_TOKEN_ENV]
    out: IO[str] = sys.stdout
    with launch(
        "tiny",
        engines=engines,
        port=port,
        engine_config=EngineConfig(num_kv_blocks=2048),
        manager_config=config,
        cluster_token=token,
        startup_timeout=START_TIMEOUT_S,
    ) as served:
        out.write(json.dumps({"ready": True, "url": served.url}) + "\n")
        out.flush()
        for line in sys.stdin:
            if line.strip() == "drop_cache":
                dropped = served.run(served.manager.drop_cache())
                out.write(json.dumps({"dropped": dropped}) + "\n")
                out.flush()


class RemoteEngine:
    """A remote engine process joined to the manager; `restart` kills it (SIGKILL) and starts a new one."""

    def __init__(self, manager_url: str, token: str) -> None:
        self.manager_url, self.token = manager_url, token
        self.kills = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    def start(self) -> None:
        port = free_port()
        self.proc = subprocess.Popen(
            [
                *(sys.executable, "-m", "server.engine", "--model", "tiny", "--port", str(port)),
                *("--manager", self.manager_url, "--name", f"load-remote-{port}", "--num-kv-blocks", "2048"),
            ],
            env={**os.environ, CLUSTER_TOKEN_ENV: self.token},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    def restart(self) -> None:
        self.stop()
        self.kills += 1
        self.start()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def engines_status(url: str, token: str) -> list[dict[str, Any]]:
    r = httpx.get(f"{url}/v1/engines", headers={"Authorization": f"Bearer {token}"}, timeout=30)
    r.raise_for_status()
    return list(r.json())


def wait_for_engines(url: str, token: str, count: int, timeout_s: float = START_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while sum(e["alive"] for e in engines_status(url, token)) < count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"fewer than {count} engines in service after {timeout_s:.0f} s")
        time.sleep(0.5)


def blocks_in_use(url: str, token: str) -> int:
    """KV blocks in use on every engine in service (remote ones: as of their last heartbeat)."""
    return sum(e["stats"]["blocks_used"] for e in engines_status(url, token) if e["alive"])


def settled_blocks(url: str, token: str, wait_s: float = 4 * HEARTBEAT_S + 2) -> int:
    """Blocks in use once remote engines had time to heartbeat their stats (0 returns at once)."""
    deadline = time.monotonic() + wait_s
    blocks = blocks_in_use(url, token)
    while blocks and time.monotonic() < deadline:
        time.sleep(0.25)
        blocks = blocks_in_use(url, token)
    return blocks


@contextlib.contextmanager
def engine_killer(remote: RemoteEngine | None, every_s: float | None) -> Iterator[None]:
    """While the body runs, SIGKILL and restart ``remote`` every ``every_s`` seconds."""
    if remote is None or not every_s:
        yield
        return
    stop = threading.Event()

    def loop() -> None:
        while not stop.wait(every_s):
            log(f"killing the remote engine (kill {remote.kills + 1})")
            remote.restart()

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


# ----------------------------------------------------------------------------------------------- the run
@dataclass
class Report:
    sessions: int
    completed: int
    seconds: float
    sessions_per_s: float
    calls_per_s: float
    p50_s: float
    p99_s: float
    errors: int
    errors_by_type: dict[str, int]
    error_examples: dict[str, str]
    lost_variables: int
    inconsistent_chains: int
    rss_before_mb: float
    rss_peak_mb: float
    rss_after_mb: float
    rss_growth_pct: float
    kv_blocks_after: int
    kv_blocks_leaked: float  # NaN: unknown (a server this tool did not start)
    engine_kills: int


def summarize(outcomes: list[SessionOutcome], seconds: float) -> dict[str, Any]:
    """Throughput, latency, errors and answer consistency of one wave (pure)."""
    done = [o for o in outcomes if not o.errors and None not in o.values]
    errors = Counter(k for o in outcomes for k in o.errors)
    examples: dict[str, str] = {}
    for o in outcomes:
        for k, m in zip(o.errors, o.messages, strict=True):
            examples.setdefault(k, m[:300])
    by_seed: dict[int, Counter[tuple[str, ...]]] = {}
    for o in done:
        by_seed.setdefault(o.seed, Counter())[tuple(v or "" for v in o.values)] += 1
    inconsistent = sum(sum(c.values()) - max(c.values()) for c in by_seed.values())
    latencies = [o.seconds for o in done]
    return {
        "sessions": len(outcomes),
        "completed": len(done),
        "seconds": seconds,
        "sessions_per_s": len(done) / seconds if seconds > 0 else math.nan,
        "calls_per_s": 3 * len(done) / seconds if seconds > 0 else math.nan,
        "p50_s": percentile(latencies, 50),
        "p99_s": percentile(latencies, 99),
        "errors": sum(errors.values()),
        "errors_by_type": dict(errors),
        "error_examples": examples,
        "lost_variables": sum(v is None for o in outcomes for v in o.values),
        "inconsistent_chains": inconsistent,
    }


def run(cfg: Config, url: str | None, server_pid: int | None, token: str) -> Report:
    hosted = HostedServer(cfg, token) if url is None else None
    remote: RemoteEngine | None = None
    try:
        base = url or hosted.url  # type: ignore[union-attr]
        pid = server_pid if hosted is None else hosted.pid
        if hosted is not None and cfg.kill_engine_every:
            remote = RemoteEngine(base, token)
            wait_for_engines(base, token, cfg.engines)
        log(f"warm-up: {cfg.warmup} sessions")
        asyncio.run(run_wave(base, cfg, cfg.warmup))
        time.sleep(cfg.settle_s)
        before = rss_bytes(pid) if pid else None
        log(f"load: {cfg.sessions} concurrent sessions of 3-call chains")
        with RssSampler(pid) as sampler, engine_killer(remote, cfg.kill_engine_every):
            outcomes, seconds = asyncio.run(run_wave(base, cfg, cfg.sessions, first=cfg.warmup))
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


def result_metrics(r: Report) -> dict[str, float | int]:
    leaked: float | int = r.kv_blocks_leaked if math.isnan(r.kv_blocks_leaked) else int(r.kv_blocks_leaked)
    return {
        "sessions": r.sessions,
        "errors": r.errors,
        "p99_s": r.p99_s,
        "rss_growth_pct": r.rss_growth_pct,
        "kv_blocks_leaked": leaked,
        "lost_variables": r.lost_variables,
        "sessions_per_s": r.sessions_per_s,
        "calls_per_s": r.calls_per_s,
        "p50_s": r.p50_s,
        "engine_kills": r.engine_kills,
    }


def table(r: Report) -> str:
    rows = [
        ["sessions (completed)", f"{r.sessions} ({r.completed})"],
        ["wall time", f"{r.seconds:.1f} s"],
        ["throughput", f"{r.sessions_per_s:.1f} sessions/s, {r.calls_per_s:.1f} calls/s"],
        ["chain latency p50 / p99", f"{r.p50_s:.2f} s / {r.p99_s:.2f} s"],
        ["errors", f"{r.errors} {r.errors_by_type or ''}".strip()],
        ["lost variables", str(r.lost_variables)],
        ["inconsistent chains", str(r.inconsistent_chains)],
        ["server RSS before / peak / after", f"{fmt_num(r.rss_before_mb)} / {fmt_num(r.rss_peak_mb)} / "
         f"{fmt_num(r.rss_after_mb)} MB ({fmt_num(r.rss_growth_pct, 1)}%)"],
        ["KV blocks in use after (cache dropped)", f"{r.kv_blocks_after} ({fmt_num(r.kv_blocks_leaked)})"],
        ["engine kills", str(r.engine_kills)],
    ]  # fmt: skip
    return markdown_table(["measure", "value"], rows, [False, True])


def parse_args(argv: list[str] | None) -> argparse.Namespace:
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
    parser.add_argument("--host-server", type=int, metavar="PORT", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.kill_engine_every is not None and args.url:
        parser.error("--kill-engine-every needs a server this tool starts (no --url)")
    for name in ("sessions", "engines", "max_tokens"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.kill_engine_every is not None and args.kill_engine_every <= 0:
        parser.error("--kill-engine-every must be positive")
    return args


def build_config(args: argparse.Namespace) -> Config:
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
