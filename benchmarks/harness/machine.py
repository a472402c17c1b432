"""The machine a run measured on and where it runs from: the checkout (`REPO_ROOT`), where results go
(`output_root`), the facts a reader needs to judge the figures (`machine_info`) and main-memory bandwidth
(`memory_bandwidth`), which bounds a batch-1 decode step.

Every benchmark reports ratios measured side by side in one run (DESIGN.md, "How performance is
measured"); what machine that run was on is recorded with them. Nothing here loads the engine: the kernels
benchmark reads its machine facts from this module, and loading the engine would skew what it measures.
"""

from __future__ import annotations

import os
import platform
import statistics
import subprocess
from pathlib import Path
from typing import Any

# Where this code lives: the checkout (git reads its commit there, the experiments run from there), or
# site-packages when installed as a wheel — never where results are written (`output_root`).
REPO_ROOT = Path(__file__).resolve().parents[2]


def output_root() -> Path:
    """Where results (``benchmarks/results/``) and the page (``docs/``) go unless told otherwise: the
    current directory — the checkout's root when run from there, as the README does; an installed package's
    own folder would be site-packages."""
    return Path.cwd()


def git_commit() -> dict[str, Any]:
    """The repository's HEAD commit and whether the work tree has uncommitted changes (None if no git)."""

    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(
                ["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10, check=True
            )
        except (OSError, subprocess.SubprocessError):
            return None
        return out.stdout.strip()

    status = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": git("rev-parse", "HEAD"), "dirty": None if status is None else bool(status)}


def cpu_model() -> str:
    """The CPU's marketing name (``/proc/cpuinfo`` on Linux, else what ``platform`` knows)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# The instruction sets a CPU engine's speed depends on (as Linux names them in /proc/cpuinfo): vector width,
# native bf16 dot products, AMX's bf16 matrix tiles.
CPU_FEATURES = ("avx2", "fma", "f16c", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16")


def cpu_features() -> dict[str, Any]:
    """Which of `CPU_FEATURES` this CPU has (``/proc/cpuinfo``; empty where unreadable), and the vector
    capability torch's own kernels chose here."""
    import torch

    flags: set[str] = set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.partition(":")[2].split())
                break
    except OSError:
        pass
    return {
        "flags": [f for f in CPU_FEATURES if f in flags],
        "torch_capability": torch.backends.cpu.get_cpu_capability(),
    }


def load_average() -> float | None:
    """One-minute load average: on a shared machine, what else was running competes with the benchmark."""
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def machine_info() -> dict[str, Any]:
    """What a reader needs to judge the figures: CPU, cores, library versions, the code's commit."""
    import torch

    info: dict[str, Any] = {
        "cpu_model": cpu_model(),
        "cpu_features": cpu_features(),
        "logical_cores": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "load_average_1m": load_average(),
        "git": git_commit(),
    }
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        info["transformers"] = None
    return info


def memory_bandwidth(size_mib: int = 256, repeats: int = 9) -> dict[str, float | int]:
    """Main-memory bandwidth as torch sees it with its current threads, in bytes per second.

    Three kernels over ``size_mib`` of fp32, each timed ``repeats`` times after one untimed pass that
    faults the pages in: ``sum`` (one read of every byte, next to no arithmetic), ``gemv`` (a matrix times
    a vector: how a batch-1 decode step reads its weights) and ``copy`` (read + write, counted as twice the
    bytes). ``read_bytes_per_s`` is the better of the two reads' medians (on some CPUs ``sum`` does not
    saturate memory with few threads, a matrix-vector product does). Measure it in the same run as the
    figures it bounds: on a shared machine the other load moves it too.
    """
    import time

    import torch

    n = size_mib * (1 << 20) // 4
    cols = 4096
    src = torch.ones(n, dtype=torch.float32)
    dst = torch.empty_like(src)
    matrix = src[: n - n % cols].view(-1, cols)
    vector = torch.ones(cols, dtype=torch.float32)
    kernels = {
        "sum": (lambda: src.sum(), src.numel() * 4),
        "gemv": (lambda: torch.mv(matrix, vector), matrix.numel() * 4),
        "copy": (lambda: dst.copy_(src), 2 * src.numel() * 4),
    }
    medians: dict[str, float] = {}
    best: dict[str, float] = {}
    for name, (kernel, nbytes) in kernels.items():
        kernel()
        rates = []
        for _ in range(repeats):
            start = time.perf_counter()
            kernel()
            rates.append(nbytes / (time.perf_counter() - start))
        medians[name], best[name] = statistics.median(rates), max(rates)
    return {
        "read_bytes_per_s": max(medians["sum"], medians["gemv"]),
        **{f"{name}_bytes_per_s": v for name, v in medians.items()},
        **{f"{name}_bytes_per_s_max": v for name, v in best.items()},
        "tensor_bytes": n * 4,
        "repeats": repeats,
        "threads": torch.get_num_threads(),
    }
