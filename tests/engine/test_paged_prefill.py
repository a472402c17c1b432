"""A fill chunk after cached tokens read in place from the paged cache (`server.engine.paged_prefill`,
`kernels.paged_prefill_attention`): the same attention as gathering the context and attending over the
copy, on the Triton kernel (interpreted here) and the reference, whatever the cached length (none, part of a
block, many blocks), chunk length (one row, several tiles) and head grouping."""

from __future__ import annotations

import pytest
import torch

from kernels import Backend, triton_available
from server.common.settings import PAGED_PREFILL
from server.engine import paged_prefill
from server.engine.attention import PrefillChunk, _prefill

BLOCK = 16


def _case(
    num_cached: int, n: int, heads: int, kv_heads: int, seed: int, dim: int = 16, device: str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, PrefillChunk]:
    g = torch.Generator().manual_seed(seed)
    blocks = -(-(num_cached + n) // BLOCK)
    pool = 3 * blocks + 4
    k_cache = torch.randn(pool, BLOCK, kv_heads, dim, generator=g).to(device)
    v_cache = torch.randn(pool, BLOCK, kv_heads, dim, generator=g).to(device)
    table = torch.randperm(pool, generator=g)[:blocks].to(device)  # scattered, as a real cache holds them
    q = torch.randn(n, heads, dim, generator=g).to(device)
    return q, k_cache, v_cache, PrefillChunk(0, n, num_cached, table)


def _in_place(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk: PrefillChunk, backend: Backend
) -> torch.Tensor:
    return paged_prefill.attend(q, k, v, chunk, 0.25, backend=backend)


# (cached, chunk, heads, kv heads, head dim): GQA 1-4 and none, a head dim that is not a power of two, a chunk
# over several row tiles, nothing cached, less than a block cached.
SHAPES = [
    (16, 5, 4, 2, 16),
    (17, 8, 4, 4, 16),
    (40, 33, 6, 2, 16),
    (100, 1, 2, 1, 16),
    (64, 16, 8, 2, 16),
    (0, 37, 6, 2, 24),
    (9, 70, 3, 1, 32),
    (5, 130, 9, 3, 64),
]


@pytest.mark.parametrize(("num_cached", "n", "heads", "kv_heads", "dim"), SHAPES)
def test_the_reference_equals_the_gathered_context(
    num_cached: int, n: int, heads: int, kv_heads: int, dim: int
) -> None:
    q, k_cache, v_cache, chunk = _case(num_cached, n, heads, kv_heads, seed=num_cached + n, dim=dim)
    want = _prefill(q, k_cache, v_cache, chunk, 0.25)  # off the CUDA switch: the gather
    got = _in_place(q, k_cache, v_cache, chunk, "reference")
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not triton_available(), reason="needs triton")
@pytest.mark.parametrize(("num_cached", "n", "heads", "kv_heads", "dim"), SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_triton_kernel_equals_the_reference(
    num_cached: int, n: int, heads: int, kv_heads: int, dim: int, dtype: torch.dtype
) -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"  # the interpreter on CPU (no bf16 there)
    q, k_cache, v_cache, chunk = _case(num_cached, n, heads, kv_heads, seed=7 * n, dim=dim, device=device)
    q, k_cache, v_cache = (x.to(dtype) for x in (q, k_cache, v_cache))
    want = _in_place(q, k_cache, v_cache, chunk, "reference")
    got = _in_place(q, k_cache, v_cache, chunk.__class__(0, n, num_cached, chunk.block_table.int()), "triton")
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


def test_bad_operands_are_refused_and_the_switch_is_cuda_only(monkeypatch: pytest.MonkeyPatch) -> None:
    q, k_cache, v_cache, chunk = _case(20, 4, 2, 2, seed=1)
    with pytest.raises(ValueError, match="no torch path"):
        _in_place(q, k_cache, v_cache, chunk, "torch")
    if triton_available():
        short = PrefillChunk(0, 4, 20, chunk.block_table[:1])  # one block of 16 for 24 tokens
        with pytest.raises(ValueError, match="cannot hold 20 \\+ 4 tokens"):
            _in_place(q, k_cache, v_cache, short, "triton")
    monkeypatch.setenv(PAGED_PREFILL.name, "1")
    assert paged_prefill.enabled(torch.device("cuda")) and not paged_prefill.enabled(torch.device("cpu"))
    monkeypatch.setenv(PAGED_PREFILL.name, "0")
    assert not paged_prefill.enabled(torch.device("cuda"))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_on_cuda_the_switch_gives_the_gathers_answer(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    q, k_cache, v_cache, chunk = _case(300, 200, 32, 8, seed=3, dim=128, device="cuda")
    q, k_cache, v_cache = (x.to(dtype) for x in (q, k_cache, v_cache))
    monkeypatch.delenv(PAGED_PREFILL.name, raising=False)
    want = _prefill(q, k_cache, v_cache, chunk, 0.125)
    monkeypatch.setenv(PAGED_PREFILL.name, "1")
    torch.testing.assert_close(_prefill(q, k_cache, v_cache, chunk, 0.125), want, atol=2e-2, rtol=2e-2)
