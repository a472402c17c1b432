"""Our C++ kernels for CPU against references we did not write in C++.

Decode attention equals the float64 reference: outputs and log-sum-exps, every path of it (AVX-512 or
AVX2 for head dims 32/64/128 with blocks of up to 16 and up to 8 query heads per KV head, plain loops
otherwise), every cache dtype, empty and ragged sequences over shuffled blocks, the same bits for a
sequence in a batch as alone; bad tables are refused.
The fused add + RMSNorm equals the torch ops it replaces (the Hugging Face reference's arithmetic; fp32 to
a few ulps).
"""

from __future__ import annotations

import math
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from kernels import cpu_kernels, reference
from kernels.settings import CPU_KERNELS
from server.engine.model import RMSNorm
from tests.kernels.cases import random_case

kernel = cpu_kernels.paged_decode_kernel()
add_rms_norm = cpu_kernels.add_rms_norm_kernel()
pytestmark = pytest.mark.skipif(
    kernel is None, reason="the CPU kernels could not be built here (see the log)"
)

TOL = {
    torch.float32: {"rtol": 1e-5, "atol": 1e-5},
    torch.bfloat16: {"rtol": 2e-2, "atol": 2e-2},
    torch.float16: {"rtol": 2e-3, "atol": 2e-3},
}


def _expected(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    outs, lses = [], []
    for b in range(q.shape[0]):
        n = int(lens[b])
        o, lse = reference.attend(
            q[b], reference.gather_tokens(k, tables[b], n), reference.gather_tokens(v, tables[b], n), scale
        )
        outs.append(o)
        lses.append(lse)
    return torch.stack(outs).float(), torch.stack(lses).float()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("head_dim", "block_size"),
    [(64, 16), (128, 16), (32, 8), (64, 32), (48, 16)],  # the last two take the plain loops
)
@pytest.mark.parametrize("seed", range(3))
def test_matches_the_reference(dtype: torch.dtype, head_dim: int, block_size: int, seed: int) -> None:
    case = random_case(seed, head_dim=head_dim, block_size=block_size, allow_empty_suffix=True)
    case = case.to("cpu", dtype)
    q, k, v = case.q, case.k_cache, case.v_cache
    tables, lens = case.suffix_block_tables, case.suffix_lens
    out, lse = kernel(q, k, v, tables, lens, case.scale)
    want_out, want_lse = _expected(q, k, v, tables, lens, case.scale)
    assert out.dtype == lse.dtype == torch.float32 and out.shape == q.shape
    torch.testing.assert_close(out, want_out, **TOL[dtype])
    torch.testing.assert_close(lse, want_lse, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("kv_heads", "group"), [(3, 3), (4, 4), (2, 8), (4, 5)])  # the last: past 16 rows
def test_a_sequence_gets_the_same_bits_in_a_batch_as_alone(
    dtype: torch.dtype, kv_heads: int, group: int
) -> None:
    """A batch may take another task shape (on AVX2, a task per sequence over all its KV heads, where one
    runs alone per KV head): each sequence's output must not change with its company."""
    gen = torch.Generator().manual_seed(kv_heads * group)
    k = torch.randn(90, 16, kv_heads, 64, generator=gen).to(dtype)
    v = torch.randn(90, 16, kv_heads, 64, generator=gen).to(dtype)
    batch = 12  # past twice the threads
    q = torch.randn(batch, kv_heads * group, 64, generator=gen).to(dtype)
    tables = torch.randperm(90, generator=gen)[: batch * 7].view(batch, 7).int()
    lens = torch.randint(1, 7 * 16 + 1, (batch,), generator=gen, dtype=torch.int32)
    out, lse = kernel(q, k, v, tables, lens, 0.125)
    want_out, want_lse = _expected(q, k, v, tables, lens, 0.125)
    torch.testing.assert_close(out, want_out, **TOL[dtype])
    torch.testing.assert_close(lse, want_lse, **TOL[dtype])
    for b in range(batch):
        alone_out, alone_lse = kernel(q[b : b + 1], k, v, tables[b : b + 1], lens[b : b + 1], 0.125)
        assert torch.equal(alone_out[0], out[b]) and torch.equal(alone_lse[0], lse[b])


def test_many_query_heads_per_kv_head_and_an_empty_sequence() -> None:
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(12, 16, 1, 64, generator=gen)
    v = torch.randn(12, 16, 1, 64, generator=gen)
    q = torch.randn(3, 12, 64, generator=gen)  # 12 query heads on one KV head: past the vector path's 8
    tables = torch.tensor([[3, 7, 1], [0, 0, 0], [11, 2, 5]], dtype=torch.int32)
    lens = torch.tensor([40, 0, 33], dtype=torch.int32)
    out, lse = kernel(q, k, v, tables, lens, 0.125)
    want_out, want_lse = _expected(q, k, v, tables, lens, 0.125)
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, want_lse)
    assert torch.all(out[1] == 0) and torch.all(lse[1] == -math.inf)


def test_a_table_pointing_outside_the_cache_is_refused_not_read() -> None:
    k = v = torch.zeros(4, 16, 1, 64)
    q = torch.zeros(1, 1, 64)

    def i32(rows: list) -> torch.Tensor:
        return torch.tensor(rows, dtype=torch.int32)

    with pytest.raises(RuntimeError, match="block 9 outside the cache"):
        kernel(q, k, v, i32([[9]]), i32([5]), 1.0)
    with pytest.raises(RuntimeError, match="context length 17 outside its table"):
        kernel(q, k, v, i32([[0]]), i32([17]), 1.0)
    with pytest.raises(RuntimeError, match="share one dtype"):
        kernel(q.double(), k, v, i32([[0]]), i32([1]), 1.0)


def test_the_engine_takes_the_kernel_only_where_it_is_vectorised() -> None:
    assert cpu_kernels.decode_kernel_covers(9, 3, 64, 16)  # SmolLM2
    assert cpu_kernels.decode_kernel_covers(32, 8, 128, 16)  # Llama-3-8B
    assert not cpu_kernels.decode_kernel_covers(32, 32, 80, 16)  # head dim 80: the plain loops
    assert not cpu_kernels.decode_kernel_covers(4, 2, 64, 32)  # blocks of 32
    assert not cpu_kernels.decode_kernel_covers(12, 1, 64, 16)  # 12 query heads per KV head


def test_an_uncovered_shape_takes_the_torch_path_in_the_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    from server.engine.attention import DecodeBatch, _decode_cpu

    def fail(*_: object) -> None:
        raise AssertionError("the C++ kernel ran an uncovered shape")

    monkeypatch.setattr(cpu_kernels, "paged_decode_kernel", lambda: fail)
    case = random_case(1, head_dim=48)  # not a vector head dim
    batch = DecodeBatch(block_tables=case.suffix_block_tables, context_lens=case.suffix_lens)
    got = _decode_cpu(case.q, case.k_cache, case.v_cache, batch, case.scale)
    want = reference.paged_decode_attention(
        case.q, case.k_cache, case.v_cache, case.suffix_block_tables, case.suffix_lens, case.scale
    )
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_turned_off_by_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CPU_KERNELS.name, "0")
    cpu_kernels.clear_cache()
    try:
        assert cpu_kernels.paged_decode_kernel() is None and cpu_kernels.add_rms_norm_kernel() is None
    finally:
        monkeypatch.delenv(CPU_KERNELS.name)
        cpu_kernels.clear_cache()
    assert cpu_kernels.paged_decode_kernel() is not None


def test_a_built_binary_is_loaded_without_the_builder(monkeypatch: pytest.MonkeyPatch) -> None:
    """The binary's name digests the sources' text, so a binary found under it is loaded as it is (a fresh
    clone's newer file times do not matter); the builder runs only where there is none."""
    assert cpu_kernels.paged_decode_kernel() is not None  # built (or found) once

    def no_build(folder: Path, binary: Path) -> None:
        raise AssertionError("the builder ran although the binary was there")

    monkeypatch.setattr(cpu_kernels, "build", no_build)
    cpu_kernels.clear_cache()
    try:
        assert cpu_kernels.paged_decode_kernel() is not None
    finally:
        cpu_kernels.clear_cache()


def test_the_kernels_build_in_seconds_from_no_torch_header() -> None:
    """The sources take raw pointers through a C ABI: none includes a torch header (parsing ATen's took most
    of a minute per file), so a first start compiles them in seconds."""
    for source in cpu_kernels.SOURCES + cpu_kernels.HEADERS:
        includes = [line for line in source.read_text().splitlines() if line.startswith("#include")]
        assert not [i for i in includes if any(t in i for t in ("ATen", "torch/", "c10/"))], source


def test_a_build_makes_a_binary_that_loads(tmp_path: Path) -> None:
    """A build from scratch into an empty folder: objects compiled, linked whole under a temporary name,
    then renamed; the result binds."""
    binary = tmp_path / "parrot_cpu_kernels_test.so"
    cpu_kernels.build(tmp_path, binary)
    assert binary.is_file() and not list(tmp_path.glob("*.partial"))
    ops = cpu_kernels._load_built(binary)
    assert ops is not None and ops.paged_decode_vector_bits() in (0, 256, 512)


def test_a_binary_that_does_not_load_is_built_again(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    assert not cpu_kernels._load_built(tmp_path / "absent.so")
    cut = tmp_path / "cut.so"
    cut.write_bytes(b"\x7fELF cut short")
    with caplog.at_level("WARNING", logger="kernels.cpu_kernels"):
        assert not cpu_kernels._load_built(cut)
    assert "does not load" in caplog.text


def test_a_live_build_is_waited_on_and_a_killed_one_s_turn_is_free(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A lock file left by a killed build hung every later start. A builder's turn is an OS lock that dies
    with its holder: a live holder is waited on, a process killed while holding it frees it."""
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLD_THE_TURN, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "holding"
        took: list[float] = []
        waiter = threading.Thread(target=lambda: _take_turn(tmp_path, took))
        with caplog.at_level("WARNING", logger="kernels.cpu_kernels"):
            waiter.start()
            waiter.join(timeout=1.0)
            assert waiter.is_alive() and not took, "the turn was taken while a live build held it"
            assert "waiting for another process's build" in caplog.text
            holder.kill()  # killed mid-build: its turn goes with it
            holder.wait()
            waiter.join(timeout=30)
        assert took
    finally:
        holder.kill()


_HOLD_THE_TURN = """
import sys, time
from pathlib import Path
from kernels import cpu_kernels
with cpu_kernels.build_turn(Path(sys.argv[1])):
    print("holding", flush=True)
    time.sleep(600)
"""


def _take_turn(folder: Path, took: list[float]) -> None:
    with cpu_kernels.build_turn(folder):
        took.append(time.monotonic())


def test_two_interpreters_build_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's builder records the sources' and interpreter's paths: two virtualenvs sharing the cache under
    one build name rebuilt it at every start in turn."""
    tag = cpu_kernels._build_tag()
    assert cpu_kernels._build_tag() == tag
    monkeypatch.setattr(sys, "executable", "/elsewhere/venv/bin/python")
    assert cpu_kernels._build_tag() != tag


def test_a_failed_build_falls_back_to_torch_and_says_why(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def no_compiler(folder: Path, binary: Path) -> None:
        raise RuntimeError("no C++ compiler on the PATH (c++, g++ or clang++)")

    monkeypatch.setattr(cpu_kernels, "build", no_compiler)
    monkeypatch.setattr(cpu_kernels, "_load_built", lambda binary: None)  # nothing built on this machine
    cpu_kernels.clear_cache()
    try:
        with caplog.at_level("WARNING", logger="kernels.cpu_kernels"):
            assert cpu_kernels.paged_decode_kernel() is None
        assert "CPU kernels unavailable, using torch ops: no C++ compiler" in caplog.text
    finally:
        monkeypatch.undo()
        cpu_kernels.clear_cache()
    assert cpu_kernels.paged_decode_kernel() is not None


def _torch_norm(norm: RMSNorm, h: torch.Tensor, delta: torch.Tensor | None) -> torch.Tensor:
    """The reference ops (what the model runs for fp32), on a copy of h that is updated in place."""
    if delta is not None:
        h.add_(delta)
    x = h.float()
    x = x * x.pow(2).mean(-1, keepdim=True).add_(norm.eps).rsqrt_()
    return x.to(h.dtype).mul_(norm.weight)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("hidden", [576, 40])  # vector lanes; plain loops
@pytest.mark.parametrize(("rows", "with_delta"), [(1, True), (7, True), (64, True), (5, False)])
def test_add_rms_norm_equals_the_torch_ops(
    dtype: torch.dtype, hidden: int, rows: int, with_delta: bool
) -> None:
    gen = torch.Generator().manual_seed(rows * hidden)
    norm = RMSNorm(hidden, 1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(hidden, generator=gen))
    h = (torch.randn(rows, hidden, generator=gen) * 3).to(dtype)
    delta = torch.randn(rows, hidden, generator=gen).to(dtype) if with_delta else None
    want_h = h.clone()
    with torch.no_grad():
        want = _torch_norm(norm, want_h, delta)
        got = add_rms_norm(h, delta, norm.weight, norm.eps)
    assert torch.equal(h, want_h)  # the residual stream gets exactly the in-place add's result
    # Only the sum of squares' order differs: at most one rounding step apart in the output dtype.
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    if dtype != torch.float32:  # rounded to 8-11 bits, nearly every element is the same number
        assert (got != want).float().mean() < 0.01


def test_the_model_norm_takes_the_kernel_for_bf16_and_fp32() -> None:
    """bf16 within its rounding; fp32 within a few ulps (the kernel sums the squares in another order)."""
    for dtype in (torch.bfloat16, torch.float32):
        norm = RMSNorm(64, 1e-6).to(dtype)
        h, delta = torch.randn(3, 64).to(dtype), torch.randn(3, 64).to(dtype)
        a, b = h.clone(), h.clone()
        with torch.no_grad():
            got = norm(a, delta)
            want = _torch_norm(norm, b, delta)
        assert torch.equal(a, b)
        tol = 1e-6 if dtype == torch.float32 else 1.6e-2
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)


def test_add_rms_norm_refuses_mismatched_shapes() -> None:
    h = torch.zeros(2, 16)
    with pytest.raises(RuntimeError, match="delta must be like h"):
        add_rms_norm(h, torch.zeros(3, 16), torch.ones(16), 1e-6)
    with pytest.raises(RuntimeError, match="weight must be"):
        add_rms_norm(h, None, torch.ones(8), 1e-6)


@pytest.mark.skipif(
    "ATen parallel backend: OpenMP" not in torch.__config__.parallel_info() or sys.platform != "linux",
    reason="torch's thread pool is not OpenMP, or no /proc/self/maps to read the loaded binaries from",
)
def test_the_kernels_run_on_torch_s_thread_pool() -> None:
    """`parallel_for` (`kernels/csrc/common.h`) is an `omp parallel` pragma: built without -fopenmp the
    kernels ran every call on one thread. The binary loaded must open OpenMP parallel regions (GOMP_parallel)
    and share torch's OpenMP runtime (one libgomp in the process)."""
    with open("/proc/self/maps") as f:
        # The path field, not the last: a binary rebuilt on disk while loaded (another checkout's process
        # building the same extension) is listed as "PATH (deleted)".
        maps = [line.split()[5] for line in f if len(line.split()) >= 6]
    binary = next(p for p in maps if "parrot_cpu_kernels_" in p and p.endswith(".so"))
    with open(binary, "rb") as f:
        opens_regions = b"GOMP_parallel" in f.read()
    assert opens_regions, f"{binary} was built without OpenMP: every kernel call runs on one thread"
    assert len({p for p in maps if "libgomp" in p or "libiomp" in p}) == 1


def test_calls_past_a_grain_split_over_threads_and_give_the_same_bits() -> None:
    """The row kernels keep small calls on one thread (a passive wake-up costs more) and split big ones:
    each row's arithmetic is the same either way, so two threads give one thread's bits."""
    ops = cpu_kernels._ops()
    assert ops is not None
    g = torch.Generator().manual_seed(0)
    bf = torch.bfloat16
    rows, heads, kv_heads, d = 700, 4, 2, 32  # past every grain (norm 512, RoPE 256, SwiGLU 64 rows)
    h, delta = torch.randn(rows, 64, generator=g).to(bf), torch.randn(rows, 64, generator=g).to(bf)
    weight = torch.randn(64, generator=g).to(bf)
    gate_up = torch.randn(rows, 128, generator=g).to(bf)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * d, generator=g).to(bf)
    cos, sin = torch.randn(rows, d, generator=g).to(bf), torch.randn(rows, d, generator=g).to(bf)
    slots = torch.randperm(rows, generator=g)

    def run() -> list[torch.Tensor]:
        k_cache = torch.zeros(rows // 4 + 1, 4, kv_heads, d, dtype=bf)
        v_cache = torch.zeros_like(k_cache)
        hh = h.clone()
        normed = ops.add_rms_norm(hh, delta, weight, 1e-5)
        q, k = ops.rope_write_kv(qkv, cos, sin, k_cache, v_cache, slots, heads, kv_heads)
        return [hh, normed, ops.silu_mul(gate_up), q, k, k_cache, v_cache]

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run()
        torch.set_num_threads(2)
        two = run()
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(one, two, strict=True):
        assert torch.equal(a, b)
