"""Every backend of the decode-attention kernels equals the reference over randomized problems.

The Triton kernels run here through the interpreter (tests/conftest.py sets TRITON_INTERPRET=1 without
CUDA), so shapes stay small; with a GPU the same tests run them on CUDA (the inputs are moved there and the
outputs back), and the ``gpu`` tests add fp16/bf16 and long contexts.
"""

from __future__ import annotations

import importlib.util
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kernels
from kernels import reference
from tests.kernels.cases import Case, random_case

BACKENDS = [
    "torch",
    pytest.param("triton", marks=pytest.mark.skipif(not kernels.triton_available(), reason="no triton")),
]
SEEDS = range(12)
FP32 = {"rtol": 1e-5, "atol": 2e-5}
HALF = {"rtol": 2e-3, "atol": 2e-3}
ROOT = Path(__file__).resolve().parents[2]
# Where the Triton backend runs: the interpreter on CPU tensors, or the GPU.
TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _on_backend(case: Case, backend: str) -> Case:
    """The case where ``backend`` runs it (CPU cases go to the GPU for Triton there)."""
    if backend == "triton" and case.q.device.type != TRITON_DEVICE:
        return case.to(TRITON_DEVICE, case.q.dtype)
    return case


def _merge(backend: str, *args: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    device = TRITON_DEVICE if backend == "triton" else args[0].device
    out, lse = kernels.merge_attention_states(*(a.to(device) for a in args), backend=backend)  # type: ignore[arg-type]
    return out.to(args[0].device), lse.to(args[0].device)


def _paged(case: Case, backend: str) -> torch.Tensor:
    home, case = case.q.device, _on_backend(case, backend)
    return _paged_here(case, backend).to(home)


def _paged_here(case: Case, backend: str) -> torch.Tensor:
    return kernels.paged_decode_attention(
        case.q,
        case.k_cache,
        case.v_cache,
        case.suffix_block_tables,
        case.suffix_lens,
        case.scale,
        backend=backend,  # type: ignore[arg-type]
    )


def _shared(case: Case, backend: str) -> torch.Tensor:
    home, case = case.q.device, _on_backend(case, backend)
    return kernels.shared_prefix_decode_attention(*case.shared_args, backend=backend).to(home)  # type: ignore[arg-type]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("seed", SEEDS)
def test_paged_decode_matches_reference(backend: str, seed: int) -> None:
    case = random_case(seed, allow_empty_suffix=True)
    expected = reference.paged_decode_attention(
        case.q, case.k_cache, case.v_cache, case.suffix_block_tables, case.suffix_lens, case.scale
    )
    torch.testing.assert_close(_paged(case, backend), expected, **FP32)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("seed", SEEDS)
def test_shared_prefix_matches_reference(backend: str, seed: int) -> None:
    case = random_case(1000 + seed, allow_empty_suffix=seed % 3 == 0)
    torch.testing.assert_close(
        _shared(case, backend), reference.shared_prefix_decode_attention(*case.shared_args), **FP32
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_head_dim_128(backend: str) -> None:
    case = random_case(7, head_dim=128, max_batch=4, max_prefix=100, max_suffix=40)
    torch.testing.assert_close(
        _shared(case, backend), reference.shared_prefix_decode_attention(*case.shared_args), **FP32
    )
    expected = reference.paged_decode_attention(
        case.q, case.k_cache, case.v_cache, case.suffix_block_tables, case.suffix_lens, case.scale
    )
    torch.testing.assert_close(_paged(case, backend), expected, **FP32)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("seed", range(3))
def test_fp16(backend: str, seed: int) -> None:
    case = random_case(2000 + seed).to("cpu", torch.float16)
    expected = reference.shared_prefix_decode_attention(*case.shared_args)
    out = _shared(case, backend)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.float(), expected.float(), **HALF)


@pytest.mark.skipif(not kernels.triton_available(), reason="no triton")
@pytest.mark.parametrize(("seed", "block_n"), [(0, 16), (1, 32), (2, 16), (3, 64)])
def test_triton_split_kv_and_many_tiles(monkeypatch: pytest.MonkeyPatch, seed: int, block_n: int) -> None:
    """Force what real sizes do on a GPU: many key splits per sequence/prefix, several row tiles a group."""
    from kernels import triton_kernels

    monkeypatch.setattr(triton_kernels, "MIN_SPLIT_TOKENS", 16)
    monkeypatch.setattr(triton_kernels, "PROGRAMS_PER_SM", 64)
    monkeypatch.setattr(triton_kernels, "PREFIX_BLOCK_M", 16)
    monkeypatch.setattr(triton_kernels, "BLOCK_N", block_n)
    case = random_case(5000 + seed, allow_empty_suffix=seed % 2 == 0, min_batch=6, min_groups=1)
    case.group_of[: len(case.group_of) // 2 + 1] = 0  # a big group: several row tiles
    torch.testing.assert_close(
        _shared(case, "triton"), reference.shared_prefix_decode_attention(*case.shared_args), **FP32
    )
    expected = reference.paged_decode_attention(
        case.q, case.k_cache, case.v_cache, case.suffix_block_tables, case.suffix_lens, case.scale
    )
    torch.testing.assert_close(_paged(case, "triton"), expected, **FP32)


@pytest.mark.parametrize("backend", [*BACKENDS, "reference"])
def test_no_groups_at_all(backend: str) -> None:
    """Zero prefix rows (G = 0): every sequence takes the plain path."""
    case = random_case(77)
    case.prefix_block_tables = torch.zeros(0, 3, dtype=torch.int32)
    case.prefix_lens = torch.zeros(0, dtype=torch.int32)
    case.group_of.fill_(-1)
    expected = reference.paged_decode_attention(
        case.q, case.k_cache, case.v_cache, case.suffix_block_tables, case.suffix_lens, case.scale
    )
    torch.testing.assert_close(_shared(case, backend), expected, **FP32)


def test_every_prefix_length_shape() -> None:
    """Edge lengths the random cases may miss: prefix 0, 1, a page, a page + 1; suffix 0 and 1."""
    for prefix in (0, 1, 16, 17):
        for suffix in (0, 1):
            case = random_case(3, max_batch=3)
            case.prefix_lens.fill_(prefix)
            case.group_of.fill_(0)
            case.suffix_lens.fill_(suffix)
            width = -(-max(prefix, 1) // 16)
            case.prefix_block_tables = torch.arange(width, dtype=torch.int32)[None].expand(
                len(case.prefix_lens), -1
            )
            expected = reference.shared_prefix_decode_attention(*case.shared_args)
            torch.testing.assert_close(_shared(case, "torch"), expected, **FP32)


@pytest.mark.parametrize("mkldnn", [True, False], ids=["onednn", "torch_mm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("seed", range(3))
def test_torch_prefix_gemm_path(
    monkeypatch: pytest.MonkeyPatch, seed: int, dtype: torch.dtype, mkldnn: bool
) -> None:
    """The torch path's large-group prefix pass (per-head GEMMs over key chunks merged by LSE), which the
    small random cases never reach: forced on every group, with chunks short enough to merge several."""
    from kernels import cpu_linear, torch_path

    monkeypatch.setattr(torch_path, "_PREFIX_MIN_GEMM_ROWS", 1)
    monkeypatch.setattr(torch_path, "_PREFIX_MIN_GEMM_ELEMS", 0)
    monkeypatch.setattr(torch_path, "_PREFIX_CHUNK_ELEMS", 1)  # the 256-key floor: 2+ chunks past 256
    if not mkldnn:
        monkeypatch.setattr(cpu_linear, "use_onednn", lambda x: False)
    # Group 0 spans three key chunks, the last one partial.
    case = random_case(700 + seed, min_batch=4, long_prefix=600).to("cpu", dtype)
    expected = reference.shared_prefix_decode_attention(*case.to("cpu", torch.float32).shared_args)
    out = _shared(case, "torch")
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), expected, **(FP32 if dtype == torch.float32 else HALF))


def test_reference_shared_equals_paged_over_concatenated_tables() -> None:
    """The spec is consistent with itself: a whole-block prefix + suffix is the plain paged context."""
    case = random_case(11, max_batch=6)
    case.prefix_lens = (case.prefix_lens // 16) * 16
    tables, lens = [], []
    for b in range(case.q.shape[0]):
        g = int(case.group_of[b])
        p_blocks = int(case.prefix_lens[g]) // 16 if g >= 0 else 0
        prefix = case.prefix_block_tables[g, :p_blocks] if g >= 0 else torch.empty(0, dtype=torch.int32)
        tables.append(torch.cat([prefix, case.suffix_block_tables[b]]))
        lens.append(p_blocks * 16 + int(case.suffix_lens[b]))
    width = max(len(t) for t in tables)
    table = torch.stack([torch.cat([t, torch.zeros(width - len(t), dtype=torch.int32)]) for t in tables])
    plain = reference.paged_decode_attention(
        case.q, case.k_cache, case.v_cache, table, torch.tensor(lens, dtype=torch.int32), case.scale
    )
    torch.testing.assert_close(reference.shared_prefix_decode_attention(*case.shared_args), plain, **FP32)


# ----------------------------------------------------------------------------------------------- merge


def _partials(seed: int, shape: tuple[int, ...] = (5, 3), dim: int = 64) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    return (
        torch.randn(*shape, dim, generator=gen),
        torch.randn(shape, generator=gen) * 5,
        torch.randn(*shape, dim, generator=gen),
        torch.randn(shape, generator=gen) * 5,
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_merge_matches_reference(backend: str) -> None:
    args = _partials(0)
    out, lse = _merge(backend, *args)
    ref_out, ref_lse = reference.merge_attention_states(*args)
    torch.testing.assert_close(out, ref_out, **FP32)
    torch.testing.assert_close(lse, ref_lse, **FP32)
    assert lse.dtype == torch.float32


@pytest.mark.parametrize("backend", BACKENDS)
def test_merge_equals_attention_over_the_union(backend: str) -> None:
    """Merging the partials of two key sets is attention over their union (the property the kernels use)."""
    gen = torch.Generator().manual_seed(5)
    q, k, v = (
        torch.randn(4, 32, generator=gen),
        torch.randn(50, 2, 32, generator=gen),
        torch.randn(50, 2, 32, generator=gen),
    )
    oa, la = reference.attend(q, k[:20], v[:20], 0.3)
    ob, lb = reference.attend(q, k[20:], v[20:], 0.3)
    full, full_lse = reference.attend(q, k, v, 0.3)
    out, lse = _merge(backend, oa.float(), la.float(), ob.float(), lb.float())
    torch.testing.assert_close(out, full.float(), **FP32)
    torch.testing.assert_close(lse, full_lse.float(), **FP32)


@pytest.mark.parametrize("backend", [*BACKENDS, "reference"])
def test_merge_guards_empty_partials(backend: str) -> None:
    out_a, lse_a, out_b, lse_b = _partials(1, shape=(4,), dim=16)
    lse_a[0] = -math.inf  # a empty: the result is b, whatever a's output holds
    out_a[0] = math.nan
    lse_b[1] = -math.inf  # b empty: the result is a
    out_b[1] = math.inf
    lse_a[2] = lse_b[2] = -math.inf  # both empty: zeros and -inf, no NaN
    out_a[2] = out_b[2] = math.nan
    out, lse = _merge(backend, out_a, lse_a, out_b, lse_b)
    torch.testing.assert_close(out[0], out_b[0], **FP32)
    torch.testing.assert_close(lse[0], lse_b[0], **FP32)
    torch.testing.assert_close(out[1], out_a[1], **FP32)
    torch.testing.assert_close(lse[1], lse_a[1], **FP32)
    assert torch.equal(out[2], torch.zeros(16)) and lse[2].item() == -math.inf
    assert torch.isfinite(out[3]).all() and torch.isfinite(lse[3])


def test_merge_keeps_half_dtype() -> None:
    args = _partials(2)
    out, lse = kernels.merge_attention_states(
        args[0].half(), args[1], args[2].half(), args[3], backend="torch"
    )
    assert out.dtype == torch.float16 and lse.dtype == torch.float32


# ------------------------------------------------------------------------------------------------- gate


def test_gate() -> None:
    # CUDA: 128 MiB saved per layer (the H100 crossover); at 4 KiB per token (bf16, 8 KV heads x 128 dims):
    four_k = 4096
    assert not kernels.should_share_prefix(8, 1024, "cuda", kv_bytes_per_token=four_k)  # measured 0.60x
    assert not kernels.should_share_prefix(8, 256, "cuda", kv_bytes_per_token=four_k)
    assert kernels.should_share_prefix(64, 1024, torch.device("cuda", 0), kv_bytes_per_token=four_k)  # 1.34x
    assert kernels.should_share_prefix(8, 6144, "cuda", kv_bytes_per_token=four_k)  # 1.23x
    assert not kernels.should_share_prefix(32, 128, "cuda")
    # Graphed steps, grouped ones too (measured end to end on a 7B shape): 512 MiB per layer.
    mha_7b = 4 * four_k  # Llama-2-7B: 32 KV heads
    assert not kernels.should_share_prefix(16, 1024, "cuda", kv_bytes_per_token=mha_7b, graphed=True)  # 0.95x
    assert kernels.should_share_prefix(16, 3840, "cuda", kv_bytes_per_token=mha_7b, graphed=True)  # 1.32x
    assert kernels.should_share_prefix(64, 1024, "cuda", kv_bytes_per_token=mha_7b, graphed=True)  # 1.28x
    # ... and where grouping would make a graphed step eager: 3 GiB.
    eager_group = {"graphed": True, "grouped_graphs": False, "kv_bytes_per_token": mha_7b}
    assert not kernels.should_share_prefix(32, 3840, "cuda", **eager_group)  # measured 0.8x
    assert kernels.should_share_prefix(64, 3840, "cuda", **eager_group)  # 1.3x
    assert kernels.should_share_prefix(2, 1024, "cpu")
    assert kernels.should_share_prefix(4, 256, "cpu")
    assert not kernels.should_share_prefix(1, 4096, "cpu")
    assert not kernels.should_share_prefix(4, 64, "cpu")
    # Smaller KV per token (e.g. 2 KV heads x 64 dims, fp32 = 1 KiB) needs more sharing to pay off.
    assert not kernels.should_share_prefix(4, 1024, "cpu", kv_bytes_per_token=1024)
    assert kernels.should_share_prefix(8, 1024, "cpu", kv_bytes_per_token=1024)
    # Plain decode in our C++ kernel: 8 members and 256 MiB of prefix KV re-read per layer at least.
    bf16, fp32 = 2 * 3 * 64 * 2, 2 * 3 * 64 * 4  # SmolLM2's K and V per token and layer
    assert not kernels.should_share_prefix(64, 256, "cpu", kv_bytes_per_token=bf16, cpu_kernel=True)  # 0.69x
    assert not kernels.should_share_prefix(4, 8192, "cpu", cpu_kernel=True)  # 4 x 4k: 0.60x
    assert not kernels.should_share_prefix(64, 4096, "cpu", kv_bytes_per_token=bf16, cpu_kernel=True)  # 0.95x
    assert kernels.should_share_prefix(64, 7680, "cpu", kv_bytes_per_token=bf16, cpu_kernel=True)  # 1.16x
    assert not kernels.should_share_prefix(64, 1024, "cpu", kv_bytes_per_token=fp32, cpu_kernel=True)  # 0.84x
    assert kernels.should_share_prefix(128, 2048, "cpu", kv_bytes_per_token=fp32, cpu_kernel=True)  # 1.10x
    assert not kernels.should_share_prefix(32, 2048, "cpu", kv_bytes_per_token=1024, cpu_kernel=True)  # 0.78x
    assert not kernels.should_share_prefix(128, 2048, "cpu", kv_bytes_per_token=1024, cpu_kernel=True)  # 1.2x
    assert kernels.should_share_prefix(128, 4000, "cpu", kv_bytes_per_token=1024, cpu_kernel=True)  # 1.45x
    assert kernels.should_share_prefix(16, 4096, "cuda", kv_bytes_per_token=mha_7b, cpu_kernel=True)  # CUDA's


def test_import_does_not_load_triton() -> None:
    code = "import sys, kernels; assert 'triton' not in sys.modules, 'triton imported eagerly'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def _nvidia_compiler() -> bool:
    spec = importlib.util.find_spec("triton")
    if spec is None or spec.origin is None:
        return False
    ptxas = Path(spec.origin).parent / "backends" / "nvidia" / "bin" / "ptxas"
    return ptxas.exists() or shutil.which("ptxas") is not None


@pytest.mark.skipif(not _nvidia_compiler(), reason="no triton NVIDIA backend / ptxas")
def test_triton_kernels_compile_for_cuda() -> None:
    """Real codegen (sm_90) of every kernel, which the interpreter alone would not exercise."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    done = subprocess.run(
        [sys.executable, "-m", "tests.kernels.compile_check", "90"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.skipif(not kernels.triton_available(), reason="no triton")
def test_triton_tile_cache_follows_in_place_updates() -> None:
    """The per-step grouping cache must notice the engine rewriting group_of in place."""
    case = _on_backend(random_case(42, min_batch=6, min_groups=2), "triton")  # mutated where it runs
    case.group_of.fill_(0)
    first = _shared(case, "triton")
    torch.testing.assert_close(first, reference.shared_prefix_decode_attention(*case.shared_args), **FP32)
    case.group_of[::2] = 1
    case.group_of[1] = -1
    torch.testing.assert_close(
        _shared(case, "triton"), reference.shared_prefix_decode_attention(*case.shared_args), **FP32
    )


# -------------------------------------------------------------------------------------------------- gpu


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("seed", range(6))
def test_cuda_kernels_match_reference(dtype: torch.dtype, seed: int) -> None:
    tol = {"rtol": 2e-2, "atol": 2e-2} if dtype == torch.bfloat16 else HALF
    for head_dim in (64, 128):
        case = random_case(3000 + seed, head_dim=head_dim, max_prefix=600, allow_empty_suffix=True).to(
            "cuda", dtype
        )
        ref = reference.shared_prefix_decode_attention(*case.shared_args)
        out = kernels.shared_prefix_decode_attention(*case.shared_args)
        assert out.dtype == dtype
        torch.testing.assert_close(out.float(), ref.float(), **tol)
        ref = reference.paged_decode_attention(
            case.q, case.k_cache, case.v_cache, case.suffix_block_tables, case.suffix_lens, case.scale
        )
        torch.testing.assert_close(_paged(case, "auto").float(), ref.float(), **tol)


@pytest.mark.gpu
def test_cuda_fp32_and_long_split_contexts() -> None:
    """Long prefixes and contexts take the split-KV paths; fp32 must stay exact (no TF32)."""
    case = random_case(4000, max_prefix=5000, max_suffix=3000, max_batch=12).to("cuda", torch.float32)
    ref = reference.shared_prefix_decode_attention(*case.shared_args)
    torch.testing.assert_close(kernels.shared_prefix_decode_attention(*case.shared_args), ref, **FP32)
    ref = reference.paged_decode_attention(
        case.q, case.k_cache, case.v_cache, case.suffix_block_tables, case.suffix_lens, case.scale
    )
    torch.testing.assert_close(_paged(case, "auto"), ref, **FP32)
