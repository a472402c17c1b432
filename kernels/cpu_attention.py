"""Our C++ decode attention for CPU (``kernels/csrc/paged_decode_cpu.cpp``), compiled on first use.

torch's fused CPU attention pays microseconds of fixed cost per (sequence, KV head) pair — GEMMs with as
few query rows as a KV head has query heads — and wants each chunk's blocks gathered into a workspace first.
At decode of a small model those costs are most of the attention time (SmolLM2, bf16, 2 cores: 64 sequences
of 64 tokens took ~1 ms per layer where the KV read is ~0.1 ms). The kernel reads the block cache in place,
one task per (sequence, KV head) on torch's own thread pool, all of that head's queries at once, with an
online softmax in float32; AVX-512 for head dims 32/64/128, plain loops elsewhere. It returns the partial
state (normalised output, log-sum-exp), so the shared-prefix path merges it as it merges the torch path's.

It is built with torch's extension builder (ninja and a C++ compiler) into torch's extension cache the first
time a process asks for it, for this machine's CPU (``-march=native``; the build's name carries the CPU's
flags, so a shared cache never hands one CPU another's binary). Where it cannot be built the torch path
runs instead and the reason is logged once; ``PARROT_CPU_KERNELS=0`` turns it off.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import threading
from collections.abc import Callable
from pathlib import Path

import torch

__all__ = ["DISABLE_ENV", "PartialAttention", "paged_decode_kernel"]

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "paged_decode_cpu.cpp"
DISABLE_ENV = "PARROT_CPU_KERNELS"  # "0": never build or use the kernel

# (q [B, H, D], k_cache, v_cache [blocks, block_size, KVH, D], block_tables [B, n] int32,
#  context_lens [B] int32, scale) -> (out [B, H, D] float32, lse [B, H] float32)
PartialAttention = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float],
    tuple[torch.Tensor, torch.Tensor],
]

_build_lock = threading.Lock()  # two engines of one process may start together: one build, one load


def _cpu_tag() -> str:
    """A short digest of what the binary depends on: the CPU's instruction sets, torch, the source."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        pass
    text = "|".join([platform.machine(), flags, torch.__version__, SOURCE.read_text()])
    return hashlib.sha256(text.encode()).hexdigest()[:12]


@functools.cache
def paged_decode_kernel() -> PartialAttention | None:
    """The compiled kernel (``torch.ops.parrot_cpu.paged_decode_partial``), built on the first call; None
    where it is turned off or cannot be built (the reason is logged)."""
    if os.environ.get(DISABLE_ENV, "1") == "0":
        return None
    with _build_lock:
        try:
            from torch.utils.cpp_extension import load

            load(
                name=f"parrot_cpu_kernels_{_cpu_tag()}",
                sources=[str(SOURCE)],
                extra_cflags=["-O3", "-march=native"],
                is_python_module=False,
                verbose=False,
            )
            kernel: PartialAttention = torch.ops.parrot_cpu.paged_decode_partial
        except Exception as exc:  # no compiler, no ninja, an unknown -march: the torch path is correct too
            log.warning("CPU decode attention kernel unavailable, using the torch path: %s", exc)
            return None
    return kernel
