"""Our C++ kernels for CPU (``kernels/csrc/``), compiled on first use: decode attention, add + RMSNorm, and
the small elementwise parts of a layer (RoPE with the KV write, SwiGLU's activation).

* **Paged decode attention** (``paged_decode_cpu.cpp``). torch's fused CPU attention pays microseconds of
  fixed cost per (sequence, KV head) pair — GEMMs with as few query rows as a KV head has query heads — and
  wants each chunk's blocks gathered into a workspace first; at decode of a small model those costs were
  most of the attention time. The kernel reads the block cache in place, one task per (sequence, KV head) on
  torch's own thread pool, all of that head's queries at once, with an online softmax in float32 (AVX-512,
  or AVX2 where that is all the CPU has, for head dims 32/64/128; plain loops elsewhere), prefetching whole
  blocks ahead since they lie anywhere in the cache. It returns the partial state (normalised output,
  log-sum-exp), so the shared-prefix path merges it as it merges the torch path's. SmolLM2 bf16 on 2 cores,
  30 layers of KV in DRAM: 2.7x the torch path at 16 sequences of ~96 tokens, 1.9x at 64 (measured while the
  kernels still ran on one thread, see `_compile_flags`: a lower bound); float32 on an AVX2 EPYC, in the
  engine: decode 1.09x at batch 16, 1.16x at 64.
* **Residual add + RMSNorm** (``rms_norm_cpu.cpp``): ``h += delta`` then the norm, in one pass per row with
  the reference's roundings (3-4x the ~9 torch ops it replaces at 1-64 rows); fp32 sums the squares in
  another order than torch, so its norms are not bit-identical to Hugging Face's (`kernels.layer_ops`).
* **RoPE + KV write** (``rope_kv_cpu.cpp``): q and k rotated out of the fused q/k/v projection and the
  step's k and v written into their cache slots, one pass per token (was ~7 ops per layer); and
  **silu(gate) * up** (``silu_mul_cpu.cpp``, was 2 ops and a temporary). Both with the reference's roundings,
  for fp32, bf16 and fp16, like the norm.
* **Linears of few rows** (``gemv_cpu.cpp``, float32 and bf16): a decode step reads every weight once; FMA
  or AVX512-BF16 dot products over the plain weight read it faster than oneDNN's GEMM at few rows
  (`kernels.cpu_linear` has the figures and the row counts each dtype takes).
* **bf16 linears over a packed weight** (``packed_gemm_cpu.cpp``): the weight packed once into panels of 16
  output features whose k-pairs lie in the lanes AVX512-BF16's dot product takes, and a register-blocked
  micro-kernel over it; faster than oneDNN's packed bf16 GEMM from 1 row to hundreds (`kernels.cpu_linear`).
* **float32 linears over a packed weight on AVX2 CPUs** (``packed_gemm_f32_cpu.cpp``): where there is no
  AVX-512 the engine runs float32 and none of the kernels above has a vector path; panels of 8 output
  features for AVX2's FMA, the same scheme as the bf16 GEMM (`kernels.cpu_linear` has the figures).

They are plain C++ behind a C ABI (no torch header: ~2 s a file to compile, where parsing ATen's cost ~18),
bound to tensors in `kernels.cpu_binding`. The first process that asks compiles them, the files in
parallel, for this machine's CPU (``-march=native``), into a folder of torch's extension cache named by a
digest of what the binary depends on: the CPU's flags (a shared cache never hands one CPU another's binary),
the interpreter's and torch's paths (two virtualenvs never rebuild each other's), the compiler and the
sources' text (a binary found under its name is loaded as it is). A build says so when it starts and what
it cost when it ends (seconds). Builders of one folder take turns under an OS lock (``flock``), which the
kernel releases when its holder exits, killed or not; the binary appears under its name only once linked
whole (a rename), so a build killed halfway leaves nothing a later start would load. Where they cannot be
built the torch ops run instead and the reason is logged once; ``PARROT_CPU_KERNELS=0`` turns them off.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from kernels.cpu_binding import CpuOps, bind
from kernels.settings import CPU_KERNELS

__all__ = [
    "AddRMSNorm",
    "CpuOps",
    "Gemv",
    "PartialAttention",
    "RopeWriteKV",
    "SiluMul",
    "add_rms_norm_kernel",
    "clear_cache",
    "decode_kernel_covers",
    "gemv_kernel",
    "packed_f32_ops",
    "packed_gemm_ops",
    "paged_decode_kernel",
    "rope_write_kv_kernel",
    "silu_mul_kernel",
]

log = logging.getLogger(__name__)

_CSRC = Path(__file__).parent / "csrc"
SOURCES = sorted(_CSRC.glob("*.cpp"))
HEADERS = sorted(_CSRC.glob("*.h"))

# (q [B, H, D], k_cache, v_cache [blocks, block_size, KVH, D], block_tables [B, n] int32,
#  context_lens [B] int32, scale) -> (out [B, H, D] float32, lse [B, H] float32)
PartialAttention = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float],
    tuple[torch.Tensor, torch.Tensor],
]
# (h [rows, hidden] contiguous, updated in place by delta when given, delta or None, weight [hidden], eps)
# -> the normalised rows
AddRMSNorm = Callable[[torch.Tensor, torch.Tensor | None, torch.Tensor, float], torch.Tensor]
# (qkv [T, (H + 2 KVH) D], cos [T, D], sin [T, D] (sign-folded, `server.engine.rope`), k_cache, v_cache,
#  slot_mapping [T] int64, heads, kv_heads) -> (q [T, H, D], k [T, KVH, D]) rotated; k and v go to the cache
RopeWriteKV = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, int],
    tuple[torch.Tensor, torch.Tensor],
]
# (gate_up [T, 2n]) -> silu(gate) * up [T, n]
SiluMul = Callable[[torch.Tensor], torch.Tensor]
# (x [M, K], weight [N, K] contiguous, of one dtype; bias [N] or None) -> x @ weight.T + bias
Gemv = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]

_build_lock = threading.Lock()  # two engines of one process may start together: one build, one load


@functools.cache
def _compile_flags() -> tuple[str, ...]:
    """The compiler's flags. With torch's OpenMP (its usual backend) the kernels open OpenMP parallel regions
    (``kernels/csrc/common.h``) and the binary links ``libgomp.so.1``, which the loader resolves to the copy
    torch already loaded: one OpenMP runtime, one thread pool. Without it they run on the calling thread."""
    openmp = "ATen parallel backend: OpenMP" in torch.__config__.parallel_info()
    return (
        "-std=c++17",
        "-O3",
        "-march=native",
        "-fPIC",
        "-fvisibility=hidden",
        *(("-fopenmp",) if openmp else ()),
    )


def _find_compiler() -> str | None:
    """The C++ compiler: the first of ``c++``, ``g++`` and ``clang++`` on the PATH; None without one."""
    return next((path for name in ("c++", "g++", "clang++") if (path := shutil.which(name))), None)


def _compiler() -> str:
    found = _find_compiler()
    if found is None:
        raise RuntimeError("no C++ compiler on the PATH (c++, g++ or clang++)")
    return found


def _torch_dir() -> Path:
    return Path(torch.__file__).resolve().parent


def _build_tag() -> str:
    """A digest of what the binary depends on: the CPU's instruction sets, the interpreter, torch (whose SLEEF
    and OpenMP it links), the compiler, the flags, and the sources, their text and where they lie."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        pass
    text = "|".join(
        [
            platform.machine(),
            str(_CSRC.resolve()),
            sys.executable,
            str(_torch_dir()),
            flags,
            torch.__version__,
            _find_compiler() or "",
            *_compile_flags(),
            *(p.read_text() for p in SOURCES + HEADERS),
        ]
    )
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def _build_dir(name: str) -> Path:
    """Where the build named ``name`` goes: a folder of its own in torch's extension cache."""
    from torch.utils.cpp_extension import get_default_build_root

    folder = Path(get_default_build_root()) / f"py{sys.version_info.major}{sys.version_info.minor}_cpu" / name
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@contextlib.contextmanager
def build_turn(folder: Path) -> Iterator[None]:
    """This process's turn to build in ``folder``, among all processes of the machine: an exclusive
    ``flock`` on ``folder/turn``, which the kernel releases when its holder exits, however it exits."""
    with open(folder / "turn", "a") as turn:
        try:
            fcntl.flock(turn, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.warning("CPU kernels: waiting for another process's build in %s", folder)
            fcntl.flock(turn, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(turn, fcntl.LOCK_UN)


def _usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _run(command: list[str]) -> None:
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode:
        tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-12:])
        raise RuntimeError(f"{Path(command[0]).name} failed ({done.returncode}): {tail}")


def build(folder: Path, binary: Path) -> None:
    """Compiles the sources into ``binary``: each file to an object in ``folder``, as many at once as this
    process has cores, then one link against torch's libraries (SLEEF's vector exp, its OpenMP runtime),
    written under a temporary name and renamed into place."""
    cxx, flags, lib = _compiler(), _compile_flags(), _torch_dir() / "lib"
    include = _torch_dir() / "include"  # sleef.h only: the kernels include no torch header

    def compile_one(source: Path) -> str:
        obj = folder / f"{source.stem}.o"
        _run([cxx, *flags, f"-I{include}", "-c", str(source), "-o", str(obj)])
        return str(obj)

    with ThreadPoolExecutor(max_workers=max(1, min(len(SOURCES), _usable_cores()))) as pool:
        objects = list(pool.map(compile_one, SOURCES))
    partial = binary.with_name(binary.name + ".partial")
    openmp = [f for f in flags if f == "-fopenmp"]
    _run(
        [
            cxx,
            "-shared",
            *objects,
            "-o",
            str(partial),
            *openmp,
            f"-L{lib}",
            "-ltorch_cpu",
            f"-Wl,-rpath,{lib}",
        ]
    )
    os.replace(partial, binary)


def _load_built(binary: Path) -> CpuOps | None:
    """The kernels of ``binary`` if a build left it, else None (its name's tag digests the sources' text, so
    it is theirs whatever their files' times say)."""
    if not binary.is_file():
        return None
    try:
        return bind(ctypes.CDLL(str(binary)))
    except (OSError, AttributeError, RuntimeError) as e:  # cut short, or of another ABI: build it again
        log.warning("CPU kernels: %s does not load (%s); building it again", binary, e)
        return None


@functools.cache
def _ops() -> CpuOps | None:
    """The kernels once built and loaded; None where they cannot be (the reason is logged)."""
    if not CPU_KERNELS.get():
        return None
    with _build_lock:
        try:
            name = f"parrot_cpu_kernels_{_build_tag()}"
            folder = _build_dir(name)
            binary = folder / f"{name}.so"
            with build_turn(folder):
                ops = _load_built(binary)
                if ops is None:
                    log.warning("CPU kernels: building them for this CPU, once (seconds) in %s", folder)
                    started = time.monotonic()
                    build(folder, binary)
                    ops = bind(ctypes.CDLL(str(binary)))
                    log.warning("CPU kernels: built in %.0f s", time.monotonic() - started)
        except Exception as exc:  # no compiler, an unknown -march: the torch ops are correct too
            log.warning("CPU kernels unavailable, using torch ops: %s", exc)
            return None
    return ops


def paged_decode_kernel() -> PartialAttention | None:
    """The paged decode attention kernel, built on the first call; None where the kernels are off or
    cannot be built (the reason is logged), or where this build has no vector path (AVX-512, or AVX2 with
    FMA and F16C): the kernel's plain loops are no match for torch's vectorised path, so they never replace
    it (see also `decode_kernel_covers`)."""
    ops = _ops()
    return None if ops is None or not ops.paged_decode_vector_bits() else ops.paged_decode_partial


def decode_kernel_covers(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int) -> bool:
    """Whether `paged_decode_kernel` runs these shapes vectorised (head dim 32/64/128, blocks of at most 16
    tokens, at most 8 query heads per KV head); elsewhere the torch path is the faster one."""
    group = num_heads // num_kv_heads
    return head_dim in (32, 64, 128) and block_size <= 16 and group <= 8


def add_rms_norm_kernel() -> AddRMSNorm | None:
    """The fused residual add + RMSNorm, built on the first call; None as for `paged_decode_kernel`."""
    ops = _ops()
    return None if ops is None else ops.add_rms_norm


def rope_write_kv_kernel() -> RopeWriteKV | None:
    """RoPE of q and k with the step's KV written to the cache, built on the first call; None as for
    `paged_decode_kernel`."""
    ops = _ops()
    return None if ops is None else ops.rope_write_kv


def silu_mul_kernel() -> SiluMul | None:
    """SwiGLU's ``silu(gate) * up`` over the fused projection, built on the first call; None as for
    `paged_decode_kernel`."""
    ops = _ops()
    return None if ops is None else ops.silu_mul


@functools.cache  # asked at every linear: one lookup per dtype
def gemv_kernel(dtype: torch.dtype) -> Gemv | None:
    """The linear of few rows for ``dtype``, built on the first call; None where the kernels are off or
    cannot be built, or where this build has no vector path for ``dtype`` (float32 needs AVX-512, bf16
    AVX512-BF16 too; other dtypes never)."""
    ops = _ops()
    return ops.gemv if ops is not None and ops.gemv_supports(dtype) else None


@functools.cache  # asked at every linear
def packed_gemm_ops() -> CpuOps | None:
    """The ops of the packed bf16 GEMM (``pack_bf16(w)``, ``packed_linear(x, packed, out_features, bias)``),
    built on the first call; None where the kernels are off or cannot be built, or where this build has no
    AVX512-BF16 path."""
    ops = _ops()
    return ops if ops is not None and ops.packed_gemm_supported() else None


@functools.cache  # asked at every linear
def packed_f32_ops() -> CpuOps | None:
    """The ops of the packed float32 GEMM (``pack_f32(w)``, ``packed_linear_f32(x, packed, out_features,
    bias)``), built on the first call; None where the kernels are off or cannot be built, or where this build
    is not an AVX2 one without AVX-512 (with AVX-512, `gemv_kernel` and oneDNN run float32)."""
    ops = _ops()
    return ops if ops is not None and ops.packed_gemm_f32_supported() else None


def clear_cache() -> None:
    """Forget whether the kernels were loaded (tests that turn them off by the environment)."""
    _ops.cache_clear()
    gemv_kernel.cache_clear()
    packed_gemm_ops.cache_clear()
    packed_f32_ops.cache_clear()
