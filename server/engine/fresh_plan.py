"""How a step's fill chunks with nothing cached are attended: on CUDA in half types, all of them in one
variable-length FlashAttention call per layer (`FreshVarlen`); elsewhere in length groups
(`server.engine.fresh_prefill`).

The varlen call needs no padding, no row gathers where the chunks lie back to back (they do in a step), and
one launch instead of a handful per group. Measured on an H100, the grouped fill of 256
SmolLM2-shaped prompts was host-bound: 47% of the engine thread's samples in attention's Python, most of it
the groups' gathers and copies, and the fill took 0.64x the time of HF's padded batch.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.device_tensors import device_tensor
from server.engine.fresh_prefill import (
    Chunk,
    FreshGroup,
    agrees_with_sdpa,
    attend_group,
    fresh_groups,
    step_rows,
)


@dataclass(frozen=True)
class FreshVarlen:
    """Every fill chunk of a step with nothing cached, attended in one variable-length FlashAttention call:
    ``rows`` their step rows (a slice where they lie back to back, else an index), ``offsets`` [n + 1] int32
    where each chunk starts within those rows, ``longest`` the longest chunk."""

    rows: slice | torch.Tensor
    offsets: torch.Tensor
    longest: int


FreshPlan = FreshVarlen | list[FreshGroup]


def plan_fresh(chunks: Sequence[Chunk], q: torch.Tensor, k: torch.Tensor) -> FreshPlan:
    """How a step's fill chunks with nothing cached are attended: one varlen call where FlashAttention's
    takes these inputs (`fresh_varlen`), else length groups (`fresh_groups`)."""
    if chunks and _varlen_applies(q, k):
        return fresh_varlen(chunks, q.device)
    return fresh_groups(chunks, q.device)


def fresh_varlen(chunks: Sequence[Chunk], device: torch.device) -> FreshVarlen:
    """The chunks in step-row order as one variable-length batch (`FreshVarlen`)."""
    ordered = sorted(chunks, key=lambda c: c.token_start)
    lengths = [c.num_tokens for c in ordered]
    offsets = [0, *itertools.accumulate(lengths)]
    return FreshVarlen(step_rows(ordered, device), device_tensor(offsets, torch.int32, device), max(lengths))


def attend_fresh(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: FreshPlan, scale: float, out: torch.Tensor
) -> None:
    """Causal attention of the planned chunks over their own K/V (`plan_fresh`); writes ``out``'s rows."""
    if isinstance(plan, FreshVarlen):
        attend_varlen(q, k, v, plan, scale, out)
        return
    for group in plan:
        attend_group(q, k, v, group, scale, out)


def attend_varlen(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: FreshVarlen, scale: float, out: torch.Tensor
) -> None:
    """One variable-length causal FlashAttention call over ``batch``'s chunks; writes ``out``'s rows."""
    rows = batch.rows
    if isinstance(rows, slice):
        out[rows] = _varlen_flash(q[rows], k[rows], v[rows], batch.offsets, batch.longest, scale)
    else:
        qr, kr, vr = (x.index_select(0, rows) for x in (q, k, v))
        out.index_copy_(0, rows, _varlen_flash(qr, kr, vr, batch.offsets, batch.longest, scale))


def _varlen_flash(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor, longest: int, scale: float
) -> torch.Tensor:
    """q [T, H, D], k/v [T, KVH, D]: causal attention within each run of rows ``offsets`` delimits."""
    return torch.ops.aten._flash_attention_forward(
        q, k, v, offsets, offsets, longest, longest, 0.0, True, False, scale=scale
    )[0]


def _varlen_applies(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether the varlen FlashAttention call takes a step's q [T, H, D] and k [T, KVH, D] (CUDA, fp16/bf16,
    a head dim it supports) and gave per-chunk causal attention on this device when checked."""
    if q.device.type != "cuda" or q.dtype not in (torch.float16, torch.bfloat16) or q.shape[-1] % 8:
        return False
    if q.shape[-1] > 256 or q.shape[1] % k.shape[1]:
        return False
    return _varlen_checked(q.device, q.dtype, q.shape[1] // k.shape[1], q.shape[-1])


@functools.cache
def _varlen_checked(device: torch.device, dtype: torch.dtype, group: int, head_dim: int) -> bool:
    """Two chunks through the varlen call against one SDPA call each, once per kind of input, with q/k/v as
    strided column views of one projection output as the engine passes them."""

    def pairs() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        gen = torch.Generator().manual_seed(0)
        heads, kv_heads, lengths = 2 * group, 2, (3, 6)
        total = sum(lengths)
        qkv = torch.randn(total, (heads + 2 * kv_heads) * head_dim, generator=gen).to(device, dtype)
        q = qkv[:, : heads * head_dim].view(total, heads, head_dim)
        k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(total, kv_heads, head_dim)
        v = qkv[:, (heads + kv_heads) * head_dim :].view(total, kv_heads, head_dim)
        offsets = torch.tensor([0, lengths[0], total], dtype=torch.int32, device=device)
        got = _varlen_flash(q, k, v, offsets, max(lengths), 0.125)
        for start, end in ((0, lengths[0]), (lengths[0], total)):
            qt, kt, vt = (x[start:end].transpose(0, 1).unsqueeze(0) for x in (q, k, v))
            gqa = group > 1
            want = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=0.125, enable_gqa=gqa)
            yield got[start:end], want[0].transpose(0, 1)

    return agrees_with_sdpa("varlen FlashAttention", pairs, "fills use length groups")
