"""One command that measures the GPU path: ``python -m benchmarks.gpu --out DIR``.

Made for a bare CUDA machine with torch, triton and transformers preinstalled and no network: what else
the project needs travels as wheels (12 MB; ``--wheels`` prints the ``pip download`` line that fetches them
for Python 3.12, and the ``pip install --target`` line to run there first). Each step runs in its own
process with a time limit, so one failure or hang costs only that step, and the whole run stays within
``--budget-s`` (default 9 minutes):

1. ``env``: the GPU, driver, torch and triton versions;
2. ``tests``: the ``gpu`` tests plus the engine's HF parity tests (their engines default to CUDA there);
3. ``kernels_bf16`` / ``kernels_fp16``: shared-prefix vs paged decode (`benchmarks.kernels`), every shape;
4. ``kernel_tuning``: the Triton kernels' tile and split-KV settings swept around the shipped ones
   (`benchmarks.kernel_tuning`);
5. ``engine``: our engine vs HF ``generate`` at batch 1/16/64/256 on random-weight SmolLM2-135M,
   Llama-3.2-1B and Llama-2-7B shapes, and the simulator's latency model fitted on the 7B
   (`benchmarks.gpu_engine`);
6. ``steps``: where a decode step's time goes (wall vs device time, the engine thread's Python) and the
   graphed shared-prefix gate's end-to-end crossover on the 7B shape (`benchmarks.gpu_steps`);
7. ``layer_diff``: each layer of the 7B shape against HF in float32 on the same weights, beside HF's own
   bf16 error: where CUDA's tokens part from HF's (`benchmarks.layer_diff`);
8. ``random_model`` + ``shared_prompt``: the quick shared-system-prompt experiment
   (`benchmarks.shared_prompt`) on CUDA, over a random SmolLM2-shaped model written as a folder.

Every step writes ``DIR/<step>.json`` (and its log ``DIR/<step>.log``); ``DIR/gpu.json`` gathers the
metrics (``kernel_speedup_b32_p4096``, ``kernel_speedup_b64_p4096``, ``decode_ratio_vs_hf_b64`` and the
rest) with the GPU's name, and a short table is printed last. Copy ``DIR/gpu.json`` to
``benchmarks/results/gpu.json`` for the results page.

    python -m benchmarks.gpu --out DIR [--budget-s 540] [--only STEP ...] [--tiny]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.harness.gpu_record import archive, env_info, gather, summary, wheel_commands

REPO = Path(__file__).resolve().parents[1]


@dataclass
class Step:
    name: str
    command: list[str]
    limit_s: float
    env: dict[str, str] = field(default_factory=dict)


# The gpu tests, the Triton kernels' tests (on CUDA there) and engine tests whose engines run on CUDA there.
TESTS = (
    "tests/kernels/test_attention.py",
    "tests/kernels/test_layer_ops.py",
    "tests/engine/test_cuda_engine.py",
    "tests/engine/test_cuda_graphs.py",
    "tests/engine/test_hf_parity.py",
    "tests/engine/test_partial_fork.py",
    "tests/engine/test_fresh_prefill.py",
    "tests/engine/test_fresh_plan.py",
    "tests/engine/test_paged_prefill.py",
)


# On a GPU the kernels compile and run for real: the sm_90 cross-compile check (17 s on the H100) and the
# lazy-import check add nothing there.
DEFAULT_TESTS_K = "not compile_for_cuda and not import_does_not_load"


def steps(out: Path, tiny: bool, tests_k: str | None = None, shapes: list[str] | None = None) -> list[Step]:
    py = [sys.executable]
    size = ["--tiny"] if tiny else []
    tests = [*py, "-m", "pytest", "-v", "-p", "no:cacheprovider", "--timeout", "120"]
    tests += [f"--junitxml={out / 'tests.xml'}", *(["-k", tests_k] if tests_k else []), *TESTS]
    engine_args = ["--shapes", *shapes] if shapes else []
    kernels = {
        short: Step(
            f"kernels_{short}",
            [
                *py,
                "-m",
                "benchmarks.kernels",
                *size,
                "--dtype",
                dtype,
                "--json",
                str(out / f"kernels_{short}.json"),
            ],
            90,
        )
        for short, dtype in (("bf16", "bfloat16"), ("fp16", "float16"))
    }
    return [
        Step("env", [*py, "-m", "benchmarks.gpu", "--env-json", str(out / "env.json")], 60),
        kernels["bf16"],
        # The CPU kernel's fixture variant would only build a C++ extension there: off.
        # 143 s of pytest on the fourth H100 run (179 tests), past a 150 s limit in its teardown.
        # 163 s on the fifth (222 tests); the sixth adds the paged prefill kernel's (a compile per shape).
        Step("tests", tests, 200 if not tiny else 600, env={"PARROT_CPU_KERNELS": "0"}),
        Step(
            "engine",
            [*py, "-m", "benchmarks.gpu_engine", *size, *engine_args, "--json", str(out / "engine.json")]
            + ([] if tiny else ["--profile-shape", "llama-2-7b"]),
            270,
        ),
        Step(
            "steps",
            [
                *py,
                "-m",
                "benchmarks.gpu_steps",
                *size,
                "--compare-layer-ops",
                "--compare-paged-prefill",
                "--compare-fresh-fill",
                "--json",
                str(out / "steps.json"),
            ],
            150,
        ),
        kernels["fp16"],
        Step(
            "kernel_tuning",
            [*py, "-m", "benchmarks.kernel_tuning", *size, "--json", str(out / "kernel_tuning.json")],
            90,
        ),
        Step(
            "random_model",
            [*py, "-m", "benchmarks.harness.random_models", "smollm2-135m", str(out / "smollm2-135m-random")],
            60,
        ),
        # Where the 7B's CUDA tokens part from HF's: each layer against HF in float32, eager, bf16.
        Step(
            "layer_diff",
            [*py, "-m", "benchmarks.layer_diff", "--json", str(out / "layer_diff.json")]
            + (
                ["--device", "cpu", "--dtype", "float32", "--prompt-len", "16", "--new", "3"]
                if tiny
                else ["--shape", "llama-2-7b"]
            ),
            90,
        ),
        Step(
            "shared_prompt",
            [
                *py,
                "-m",
                "benchmarks.shared_prompt",
                "--tiny" if tiny else "--quick",
                "--device",
                "cuda" if not tiny else "cpu",
                "--model",
                str(out / "smollm2-135m-random"),
                "--json",
                str(out / "shared_prompt.json"),
            ],
            120,
        ),
    ]


def run_step(step: Step, out: Path, deadline: float) -> dict[str, Any]:
    """Run one step within its limit and the run's deadline; its output goes to ``DIR/<step>.log``."""
    limit = max(1.0, min(step.limit_s, deadline - time.monotonic()))
    log_path = out / f"{step.name}.log"
    started = time.monotonic()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **step.env}
    with log_path.open("w") as log:
        try:
            proc = subprocess.run(
                step.command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, timeout=limit, env=env
            )
            status = "ok" if proc.returncode == 0 else f"exit {proc.returncode}"
        except subprocess.TimeoutExpired:
            status = f"timed out after {limit:.0f} s"
    seconds = time.monotonic() - started
    tail = log_path.read_text(errors="replace").splitlines()[-3:]
    print(f"[{step.name}] {status} in {seconds:.0f} s: {' | '.join(tail)[-200:]}", flush=True)
    return {"status": status, "seconds": round(seconds, 1)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, help="folder for every step's JSON and log")
    p.add_argument("--budget-s", type=float, default=540.0, help="the whole run's time limit (default 540)")
    p.add_argument("--only", nargs="+", help="run only these steps")
    p.add_argument("--tiny", action="store_true", help="smallest sizes: a harness check (on CPU too)")
    p.add_argument(
        "--tests-k",
        default=DEFAULT_TESTS_K,
        help="pytest -k expression for the tests step (default: leave out the checks a real GPU makes moot)",
    )
    p.add_argument("--shapes", nargs="+", help="model shapes of the engine step (default: all)")
    p.add_argument(
        "--archive", type=Path, help="also write DIR as a .tar.gz here after every step (partial results)"
    )
    p.add_argument("--env-json", type=Path, help=argparse.SUPPRESS)  # the env step itself
    p.add_argument("--wheels", action="store_true", help="print how to carry the missing packages, and exit")
    args = p.parse_args(argv)
    if args.wheels:
        print(wheel_commands())
        return
    if args.env_json:
        args.env_json.write_text(json.dumps(env_info(), indent=2) + "\n")
        return
    if args.out is None:
        p.error("--out DIR is required")
    args.out.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + args.budget_s
    statuses: dict[str, dict[str, Any]] = {}
    chosen = [
        s
        for s in steps(args.out, args.tiny, args.tests_k, args.shapes)
        if not args.only or s.name in args.only
    ]
    for step in sorted(chosen, key=lambda s: args.only.index(s.name) if args.only else 0):
        if time.monotonic() > deadline - 5:
            statuses[step.name] = {"status": "not run: out of time", "seconds": 0.0}
            continue
        statuses[step.name] = run_step(step, args.out, deadline)
        record = gather(args.out, statuses)
        (args.out / "gpu.json").write_text(json.dumps(record, indent=2) + "\n")
        if args.archive:
            archive(args.out, args.archive)
    print(summary(gather(args.out, statuses)))


if __name__ == "__main__":
    main()
