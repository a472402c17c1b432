"""Keep glibc from returning freed memory to the OS on every large free — and return it when idle.

CPU inference allocates and frees multi-megabyte tensors many times per step. With glibc's defaults, each
such allocation in a non-main thread (the engine loop thread) is a fresh `mmap` whose pages fault in again
on first touch: measured 2-3x slower attention on the engine thread than on the main thread. Raising the
mmap and trim thresholds makes freed blocks reusable. It is process-wide and harmless elsewhere, so it is
applied once, when the first engine starts, and only where glibc is the allocator. The price is that memory
a burst of work freed stays with the process; `release_free_memory` hands it back (the server calls it when
it goes idle), so a server's footprint returns to what it was before a load.

CPython's own small-object allocator (pymalloc) keeps the other half: it frees a 1 MiB arena only when every
object in it is gone, so a burst of sessions leaves its arenas pinned by the few objects that outlive it
(measured after 1,000 concurrent sessions: 204 arenas where there had been 109, 94 MB of them empty pools,
+12% RSS for good). The servers' command lines therefore run with ``PYTHONMALLOC=malloc``
(`server.common.server_env`): objects then live on glibc's heap, which the idle trim returns page by
page (the same load: RSS back to -0.1%, throughput within the run-to-run spread).

It lives outside `server.engine` so that the kernels benchmark applies it too without importing the engine.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import sys

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD_MAX = 32 << 20  # glibc's ceiling for M_MMAP_THRESHOLD on 64-bit
_TRIM_THRESHOLD = 1 << 30
PYTHON_ALLOCATOR_ENV = "PYTHONMALLOC"  # CPython's allocator; "malloc": objects on the C heap
OBJECTS_ON_MALLOC = "malloc"


@functools.cache
def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        return ctypes.CDLL(name)
    except OSError:
        return None


def release_free_memory() -> bool:
    """Return the heap's free pages to the OS (glibc ``malloc_trim``); True if any were."""
    libc = _libc()
    try:
        return libc is not None and libc.malloc_trim(0) == 1
    except AttributeError:  # not glibc
        return False


@functools.cache
def tune_glibc_malloc() -> bool:
    """Apply the thresholds once; True if glibc accepted them."""
    libc = _libc()
    if libc is None:
        return False
    try:
        ok = libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX) == 1
        ok = libc.mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD) == 1 and ok
    except AttributeError:  # not glibc (musl has no mallopt)
        return False
    log.debug("glibc malloc thresholds raised: %s", ok)
    return ok


def glibc_trims() -> bool:
    """Whether glibc is the allocator (with ``malloc_trim``): objects on malloc then pay off."""
    libc = _libc()
    return libc is not None and hasattr(libc, "malloc_trim")
