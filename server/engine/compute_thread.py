"""Which thread does an engine's torch work: one thread per engine, and loading on a thread that ends.

torch runs its CPU ops on OpenMP, whose thread pool (libgomp's) belongs to the thread that opened a parallel
region: every thread that ever runs a parallel op keeps a pool of its own for as long as it lives. Once the
pools hold more threads than there are CPUs, libgomp cuts its spin-wait to ~100 loops, so the pool's
threads fall asleep between two ops and each op pays a futex wake-up. A decode step is hundreds of short
ops: on 2 cores, SmolLM2's 120 linears of one token took 10.6 ms when the engine thread was the only one
that had run parallel ops, and 16-17 ms once the main thread had run any (loading the model there was
enough). A thread's pool goes away when the thread ends.

So an engine loads its model on a thread that ends when the load is done (`on_own_thread`), allocates its KV
cache and packs its weights on its own engine thread, and runs every step there. Whoever shares the process
should keep parallel torch work off other long-lived threads too (benchmarks run their baselines through
`on_own_thread`).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

__all__ = ["on_own_thread"]

T = TypeVar("T")


def on_own_thread(fn: Callable[[], T], name: str = "parrot-load") -> T:
    """``fn()`` on a new thread that ends when it returns (taking its OpenMP pool with it); its result or
    its exception, here."""
    with ThreadPoolExecutor(1, thread_name_prefix=name) as pool:
        return pool.submit(fn).result()
