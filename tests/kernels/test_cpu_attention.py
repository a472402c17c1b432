"""Our C++ CPU decode attention equals the float64 reference: outputs and log-sum-exps, every path of it
(AVX-512 for head dims 32/64/128 with blocks of up to 16 and up to 8 query heads per KV head, plain loops
otherwise), every cache dtype, empty and ragged sequences over shuffled blocks; bad tables are refused."""

from __future__ import annotations

import math

import pytest
import torch

from kernels import cpu_attention, reference
from tests.kernels.cases import random_case

kernel = cpu_attention.paged_decode_kernel()
pytestmark = pytest.mark.skipif(kernel is None, reason="the CPU kernel could not be built here (see the log)")

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


def test_turned_off_by_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cpu_attention.DISABLE_ENV, "0")
    cpu_attention.paged_decode_kernel.cache_clear()
    try:
        assert cpu_attention.paged_decode_kernel() is None
    finally:
        monkeypatch.delenv(cpu_attention.DISABLE_ENV)
        cpu_attention.paged_decode_kernel.cache_clear()
    assert cpu_attention.paged_decode_kernel() is not None
