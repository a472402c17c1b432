"""The environment the servers' command lines run in, set before anything reads it: the process re-executes
itself (same pid, same command line) with what the user has not set.

- ``PYTHONMALLOC=malloc`` where glibc is the allocator: CPython's objects on glibc's heap, whose idle trim
  returns a burst's memory to the OS (`server.common.malloc_tuning`).
- ``OMP_WAIT_POLICY=PASSIVE``: torch's OpenMP threads sleep between parallel regions instead of spinning.
  Spinning threads lose to any other process on a shared machine (a CI runner, a laptop, a container): on 2
  cores beside a busy 1-core co-tenant, SmolLM2 fp32 decoded 5.9 tok/s at batch 1 and 50.6 at 16 spinning,
  16.5 and 104.9 passive (2.8x, 2.1x; one core's worth of the idle rate is 11.4 and 94). The price on an
  idle machine: 22.7 -> 19.1 tok/s at batch 1, 187 -> 176 at 16. ``OMP_WAIT_POLICY=ACTIVE`` keeps the
  spinning (a dedicated machine). libgomp reads the variable once, when torch loads it: hence the re-exec.
- ``OMP_NUM_THREADS``, only where a cgroup CPU quota (a container's ``--cpus``) allows fewer cores than
  the affinity holds: as many threads as the quota's whole cores (`server.common.cpu_budget`).
"""

from __future__ import annotations

import os
import sys

from server.common.cpu_budget import affinity_cores, cpu_budget, quota_cores
from server.common.malloc_tuning import OBJECTS_ON_MALLOC, PYTHON_ALLOCATOR_ENV, glibc_trims

WAIT_POLICY_ENV = "OMP_WAIT_POLICY"
THREADS_ENV = "OMP_NUM_THREADS"
PASSIVE = "PASSIVE"


def server_env() -> dict[str, str]:
    """The variables the servers run with, where the user has not set them."""
    wanted = {WAIT_POLICY_ENV: PASSIVE}
    if glibc_trims():
        wanted[PYTHON_ALLOCATOR_ENV] = OBJECTS_ON_MALLOC
    affinity = affinity_cores()
    threads = cpu_budget(affinity, quota_cores())
    if threads < affinity:
        wanted[THREADS_ENV] = str(threads)
    return {k: v for k, v in wanted.items() if k not in os.environ}


def restart_with_server_env() -> None:
    """Re-execute this process — same pid, same command line — with `server_env`'s variables; nothing
    happens when they are all set already (the user's values stand), or on interpreters other than
    CPython. Call it first thing, before any thread starts."""
    missing = server_env()
    if not missing or sys.implementation.name != "cpython":
        return
    os.environ.update(missing)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])
