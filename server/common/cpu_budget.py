"""How many cores this process may use: its CPU affinity, bounded by its cgroup's CPU quota.

libgomp sizes torch's thread pool from the affinity alone. A container given 2 CPUs' worth of time on a
64-core host (``docker run --cpus 2``, a Kubernetes limit) keeps all 64 cores in its affinity: 64 threads
would share 2 cores' time, each step waiting on the slowest throttled thread. The quota is read from the
process's own cgroup: ``cpu.max`` (cgroup v2: ``"200000 100000"`` is 2 cores, ``"max 100000"`` none) or
``cpu.cfs_quota_us`` / ``cpu.cfs_period_us`` (v1; a quota of -1 is none).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

__all__ = ["affinity_cores", "cpu_budget", "quota_cores"]

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")


def affinity_cores() -> int:
    """The cores this process may run on (all of them where the platform has no affinity)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def quota_cores(root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> float | None:
    """The cores' worth of time the process's cgroup may use per period, or None without a quota (or where
    none can be read: not Linux, no cgroup filesystem)."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2: one hierarchy
            quota = _v2_quota(root, path)
        elif "cpu" in controllers.split(","):
            quota = _v1_quota(root / controllers, path)
        else:
            continue
        if quota is not None:
            return quota
    return None


def cpu_budget(affinity: int, quota: float | None) -> int:
    """Threads to run: the cores of the affinity, at most the whole cores of the quota (at least one)."""
    if quota is None:
        return affinity
    return max(1, min(affinity, math.floor(quota)))


def _v2_quota(root: Path, path: str) -> float | None:
    for folder in _own_then_root(root, path):
        try:
            limit, period = (folder / "cpu.max").read_text().split()[:2]
        except (OSError, ValueError):
            continue
        return None if limit == "max" else int(limit) / int(period)
    return None


def _v1_quota(root: Path, path: str) -> float | None:
    for folder in _own_then_root(root, path):
        try:
            limit = int((folder / "cpu.cfs_quota_us").read_text())
            period = int((folder / "cpu.cfs_period_us").read_text())
        except (OSError, ValueError):
            continue
        return None if limit <= 0 or period <= 0 else limit / period
    return None


def _own_then_root(root: Path, path: str) -> list[Path]:
    """The process's cgroup folder, then the mount's root (inside a container the cgroup namespace shows
    its own cgroup as the root, and the path may not exist under the mount)."""
    own = root / path.lstrip("/")
    return [own] if own == root else [own, root]
