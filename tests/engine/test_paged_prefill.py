"""A fill chunk after cached tokens read in place from the paged cache (`server.engine.paged_prefill`): the
same attention as gathering the context and running SDPA over the copy, on the kernels' torch path and the
Triton kernels (interpreted here), whatever the cached length, chunk length and head grouping."""

from __future__ import annotations

import pytest
import torch

from kernels import Backend, triton_available
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
    operands = paged_prefill.tables(chunk.block_table, chunk.num_cached, chunk.num_tokens, BLOCK)
    assert operands is not None
    return paged_prefill.attend(q, k, v, operands, 0.25, backend=backend)


SHAPES = [(16, 5, 4, 2), (17, 8, 4, 4), (40, 33, 6, 2), (100, 1, 2, 1), (64, 16, 8, 2)]


@pytest.mark.parametrize(("num_cached", "n", "heads", "kv_heads"), SHAPES)
def test_equals_the_gathered_context_on_the_torch_path(
    num_cached: int, n: int, heads: int, kv_heads: int
) -> None:
    q, k_cache, v_cache, chunk = _case(num_cached, n, heads, kv_heads, seed=num_cached + n)
    want = _prefill(q, k_cache, v_cache, chunk, 0.25)  # off the CUDA switch: the gather
    got = _in_place(q, k_cache, v_cache, chunk, "torch")
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not triton_available(), reason="needs triton")
@pytest.mark.parametrize(("num_cached", "n", "heads", "kv_heads"), SHAPES[:3])
def test_equals_the_gathered_context_on_the_triton_kernels(
    num_cached: int, n: int, heads: int, kv_heads: int
) -> None:
    q, k_cache, v_cache, chunk = _case(num_cached, n, heads, kv_heads, seed=7 * n)
    want = _prefill(q, k_cache, v_cache, chunk, 0.25)
    got = _in_place(q, k_cache, v_cache, chunk, "triton")
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_no_whole_cached_block_is_left_to_the_gather_and_the_switch_is_cuda_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _, _, _, chunk = _case(BLOCK - 1, 4, 2, 2, seed=1)
    assert paged_prefill.tables(chunk.block_table, BLOCK - 1, 4, BLOCK) is None
    monkeypatch.setenv(paged_prefill.ENABLE_ENV, "1")
    assert paged_prefill.enabled(torch.device("cuda")) and not paged_prefill.enabled(torch.device("cpu"))
    monkeypatch.setenv(paged_prefill.ENABLE_ENV, "0")
    assert not paged_prefill.enabled(torch.device("cuda"))


@pytest.mark.gpu
def test_on_cuda_the_switch_gives_the_gathers_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    q, k_cache, v_cache, chunk = _case(300, 64, 8, 2, seed=3, dim=64, device="cuda")
    monkeypatch.delenv(paged_prefill.ENABLE_ENV, raising=False)
    want = _prefill(q, k_cache, v_cache, chunk, 0.125)
    assert chunk.in_place is None  # switched off: nothing built
    monkeypatch.setenv(paged_prefill.ENABLE_ENV, "1")
    torch.testing.assert_close(_prefill(q, k_cache, v_cache, chunk, 0.125), want, atol=1e-3, rtol=1e-3)
    built = chunk.in_place
    assert isinstance(built, paged_prefill.InPlaceTables)  # built by the first layer, reused by the next
    torch.testing.assert_close(_prefill(q, k_cache, v_cache, chunk, 0.125), want, atol=1e-3, rtol=1e-3)
    assert chunk.in_place is built
