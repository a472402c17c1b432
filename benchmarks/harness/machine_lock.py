"""One measured benchmark run per machine at a time.

Two benchmark processes on a small machine measure each other: on 2 cores their OpenMP teams spin against
each other and engine steps that take 3 ms take 200 ms, intermittently — a stall that reads like the
system's own. The runner holds `exclusive_machine` for every measured size (a ``--tiny`` harness check is
exempt: its figures mean nothing); a second measured run refuses at once, naming the holder.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

__all__ = ["LOCK_PATH", "MachineBusyError", "exclusive_machine"]

LOCK_PATH = Path(tempfile.gettempdir()) / "parrot-benchmarks.lock"


class MachineBusyError(RuntimeError):
    """Another measured benchmark run holds the machine."""


@contextlib.contextmanager
def exclusive_machine(path: Path = LOCK_PATH) -> Iterator[None]:
    """Hold the machine's benchmark lock (an advisory ``flock``, released when the process ends, however it
    ends) for the ``with`` block; `MachineBusyError` at once if another run holds it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            raise MachineBusyError(
                f"another measured benchmark run (pid {holder}) holds {path}: two runs on one machine slow "
                "each other's engine steps and both figures are wrong; wait for it to end (a --tiny "
                "harness check may run beside it)"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)
