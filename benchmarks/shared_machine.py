"""The engine on a shared machine: ours and vLLM's CPU build, idle and beside a co-tenant process.

Machines are shared (CI runners, laptops, containers): another process may keep a core busy while the engine
serves. A co-tenant here is ``--co-tenant-cores`` Python busy loops (each keeps one core busy, as a compile
or a test run would). Our engine runs as ``python -m server`` runs it (its environment: `server_env`, so
OpenMP threads that sleep between parallel regions, and as many as the cgroup's CPU quota allows); vLLM in its
worker process with its own settings (`benchmarks.harness.vllm_settings`). Every round times each system
idle and under the co-tenant at every batch size (``T(1)`` and ``T(N)`` as in ``engine_throughput``: decode
tok/s = ``B (N - 1) / (T(N) - T(1))``), the rounds alternating which condition goes first; medians over
the rounds.

* **fair share**: ours under the co-tenant over our idle rate scaled to the cores the co-tenant leaves
  (``idle x (cores - co-tenant cores) / cores``): 1.0 is exactly the idle per-core rate on the cores left;
  the goal is at least 1 / 1.2.
* **vs vLLM**: ours over vLLM's, under the co-tenant and idle (goal: at least 1.0 under it).

    python -m benchmarks.shared_machine [--quick | --tiny] [--model smollm2] [--json PATH]
        [--vllm-python PATH ...]

Last line: ``RESULT shared_machine fair_share_b1=... busy_vs_vllm_b1=... idle_vs_vllm_b1=...``.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from server.common.server_env import restart_with_server_env

if __name__ == "__main__":  # as `python -m server` runs: the server's thread settings before torch loads
    restart_with_server_env()

from benchmarks.harness import record
from benchmarks.harness.batch_timing import time_batch
from benchmarks.harness.engine_batches import make_prompts, workload
from benchmarks.harness.generators import Generator, OurEngine, model_record
from benchmarks.harness.hf_generate import hf_folder
from benchmarks.harness.output import log, markdown_table
from benchmarks.harness.stats import safe_ratio
from benchmarks.harness.vllm_generate import start_vllm
from benchmarks.harness.vllm_settings import add_vllm_flags
from server.common.cpu_budget import affinity_cores, cpu_budget, quota_cores
from server.engine import EngineConfig, LLMEngine

NAME = "shared_machine"
CONDITIONS = ("idle", "busy")


@dataclass(frozen=True)
class Config:
    batches: tuple[int, ...] = (1, 16)
    prompt_len: int = 64  # the longest prompt; the others are spread down to `spread * prompt_len`
    spread: float = 0.5
    new_tokens: int = 32
    rounds: int = 5
    co_tenant_cores: int = 1
    repeats: int = 1  # per round and condition (`time_batch`)
    min_time_s: float = 0.0
    seed: int = 0


FULL = Config(new_tokens=64, rounds=7)
QUICK = Config()
TINY = Config(batches=(1, 4), prompt_len=16, new_tokens=4, rounds=1)


@contextmanager
def co_tenant(cores: int) -> Iterator[list[subprocess.Popen[bytes]]]:
    """``cores`` busy loops (their processes) running for as long as the block does."""
    loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(cores)]
    try:
        yield loops
    finally:
        for loop in loops:
            loop.kill()
            loop.wait()


Rates = dict[str, dict[str, dict[int, float]]]  # system -> condition -> batch -> decode tok/s


def measure(cfg: Config, systems: list[Generator], tokens: list[int]) -> Rates:
    """Decode tok/s per system, condition and batch: the median over the rounds."""
    rates: dict[str, dict[str, dict[int, list[float]]]] = {
        s.name: {c: {b: [] for b in cfg.batches} for c in CONDITIONS} for s in systems
    }
    for round_ in range(cfg.rounds):
        for condition in CONDITIONS if round_ % 2 == 0 else CONDITIONS[::-1]:
            with co_tenant(cfg.co_tenant_cores if condition == "busy" else 0):
                for batch in cfg.batches:
                    prompts = make_prompts(tokens, batch, cfg)
                    timed = time_batch(systems, prompts, cfg.new_tokens, cfg.repeats, cfg.min_time_s)
                    for name, r in timed.rates.items():
                        rates[name][condition][batch].append(r.decode_tps.value)
            log(f"round {round_ + 1}/{cfg.rounds} {condition} done")
    return {
        s: {c: {b: statistics.median(v) for b, v in per.items()} for c, per in by.items()}
        for s, by in rates.items()
    }


def metrics(cfg: Config, rates: Rates, cores: int) -> dict[str, float]:
    """The fair-share and ours-over-vLLM ratios per batch (vLLM's only when it ran)."""
    left = max(cores - cfg.co_tenant_cores, 1) / cores
    out: dict[str, float] = {}
    ours = rates["ours"]
    for b in cfg.batches:
        out[f"fair_share_b{b}"] = round(safe_ratio(ours["busy"][b], ours["idle"][b] * left), 3)
        out[f"ours_idle_tps_b{b}"] = round(ours["idle"][b], 1)
        out[f"ours_busy_tps_b{b}"] = round(ours["busy"][b], 1)
        if "vllm" in rates:
            for c in CONDITIONS:
                out[f"{c}_vs_vllm_b{b}"] = round(safe_ratio(ours[c][b], rates["vllm"][c][b]), 3)
    return out


def main(argv: list[str] | None = None) -> None:
    p = record.parser(
        __doc__,
        "batches 1 and 16, 32 new tokens, 5 rounds (~5 min with vLLM)",
        Config,
        rounds="rounds of idle + co-tenant timings (median)",
        co_tenant_cores="cores the co-tenant keeps busy",
    )
    add_vllm_flags(p)
    args = p.parse_args(argv)
    cfg = record.configured(args, FULL, QUICK, TINY)
    rec = record.Recorder(NAME, args)
    cores = cpu_budget(affinity_cores(), quota_cores())
    if cfg.co_tenant_cores >= cores:
        raise SystemExit(
            f"--co-tenant-cores {cfg.co_tenant_cores} leaves none of this machine's {cores} cores"
        )
    longest = cfg.prompt_len + cfg.new_tokens + 16  # tokens a request holds at most
    config = EngineConfig(device="cpu", max_num_seqs=max(cfg.batches))
    log(f"loading {args.model} ...")
    with (
        tempfile.TemporaryDirectory(prefix=f"{NAME}-") as tmp,
        LLMEngine.from_pretrained(args.model, config) as engine,
    ):
        max_len = min(engine.max_model_len, longest)
        systems: list[Generator] = [ours := OurEngine(engine)]
        vllm = None
        if args.vllm_python:
            folder = hf_folder(args.model, engine, Path(tmp), engine.config.seed)
            vllm = start_vllm(args, folder, engine, max_len, max(cfg.batches), Path(tmp))
            systems.append(vllm)
        try:
            rates = measure(cfg, systems, workload(engine.tokenizer, 4 * cfg.prompt_len))
        finally:
            ours.close()
            if vllm is not None:
                vllm.close()
        model = model_record(args.model, engine)
    print(rec.header(f"{model['name']}, {cfg.co_tenant_cores}-core co-tenant, {cores} cores"))
    rows = [[f"{s} {c}", *(f"{rates[s][c][b]:.1f}" for b in cfg.batches)] for s in rates for c in CONDITIONS]
    headers = ["decode tok/s", *(f"b{b}" for b in cfg.batches)]
    print(markdown_table(headers, rows, [False, *(True for _ in cfg.batches)]))
    rec.finish(
        metrics(cfg, rates, cores),
        config=cfg,
        model=model,
        cores=cores,
        rates=rates,
        vllm=vllm.info if vllm else None,
        engine_config=asdict(config),
    )


if __name__ == "__main__":
    main()
