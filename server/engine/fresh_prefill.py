"""Fill attention for chunks with nothing cached before them: batched in groups of similar length.

With many short prompts in a step, one attention call per chunk per layer costs more than the attention
on a GPU (hundreds of launches per layer: on an H100 our fill of 256 prompts of SmolLM2's shape ran at
0.29x Hugging Face's padded batch), so there such chunks are padded at their ends into a few batched causal
calls (`fresh_groups`, `attend_group`); under the causal mask no real token sees the padding. On CPU each
chunk keeps its own call (`MIN_SHARE_BY_DEVICE`).

Where `server.engine.fresh_plan` cannot batch them into one variable-length call, these groups serve. On
CUDA the causal calls go to FlashAttention directly (`causal_attention`), not through SDPA's dispatcher: on
an H100 that picks cuDNN, which builds an execution plan for every new shape, and a serving engine's fill
steps bring new shapes all the time. Measured there (an H100): grouping alone left the 256-prompt fill
at 0.30x HF; over a cold and a warm fill the engine thread spent 46% of its samples inside those SDPA calls,
and in a warm one the GPU was busy 64 of 400 ms.
"""

from __future__ import annotations

import functools
import itertools
import logging
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from kernels.device_tensors import device_tensor

log = logging.getLogger(__name__)


class Chunk(Protocol):
    """A run of a step's rows (`server.engine.attention.PrefillChunk` is one)."""

    @property
    def token_start(self) -> int: ...

    @property
    def num_tokens(self) -> int: ...


def step_rows(chunks: Sequence[Chunk], device: torch.device) -> slice | torch.Tensor:
    """The step rows of ``chunks``, in their order: one slice where each starts where the last ended (a
    step's chunks do), else an int64 index on ``device``."""
    if all(a.token_start + a.num_tokens == b.token_start for a, b in itertools.pairwise(chunks)):
        return slice(chunks[0].token_start, chunks[-1].token_start + chunks[-1].num_tokens)
    spans = (range(c.token_start, c.token_start + c.num_tokens) for c in chunks)
    return device_tensor([r for span in spans for r in span], torch.int64, device)


@dataclass(frozen=True)
class FreshGroup:
    """Fill chunks with nothing cached before them, of similar lengths, attended in one batched call: each
    padded (at its end) to the longest, ``rows`` [G * L] the step rows of the padded batch (padding repeats
    a chunk's first row), ``valid`` the positions of that batch that are real tokens."""

    size: int  # G chunks
    length: int  # L, the longest
    rows: torch.Tensor  # [G * L] int64
    valid: torch.Tensor  # [real tokens] int64, into [G * L]
    start: int  # the first row of the longest chunk (a group of one is rows [start, start + L))


# A chunk joins a group while it is at least this share of the group's longest (padding wastes at most the
# rest of the attention work, a small part of a fill next to its linears). Only on a GPU: on 2 CPU cores
# a call costs little next to its work, and 64 prompts of 32-64 tokens filled 0.93-1.03x as fast grouped as
# one call each (SmolLM2, bf16), so there each chunk keeps its own call and no padding.
MIN_SHARE_BY_DEVICE: dict[str, float] = {"cuda": 0.75}


def fresh_groups(
    chunks: Sequence[Chunk], device: torch.device, min_share: float | None = None
) -> list[FreshGroup]:
    """Chunks with nothing cached, longest first, cut into groups of similar length (`FreshGroup`).

    One causal attention call per group instead of one per chunk: with many short prompts in a step the
    per-call cost dominates (on a GPU, hundreds of launches per layer). Padding sits at each chunk's end,
    so under the causal mask no real token sees it.
    """
    share = MIN_SHARE_BY_DEVICE.get(device.type, math.inf) if min_share is None else min_share
    groups: list[FreshGroup] = []
    ordered = sorted(chunks, key=lambda c: c.num_tokens, reverse=True)
    while ordered:
        longest = ordered[0].num_tokens
        short = (i for i, c in enumerate(ordered) if c.num_tokens < share * longest)
        count = max(1, next(short, len(ordered)))  # ordered longest first: the group is a prefix
        members, ordered = ordered[:count], ordered[count:]
        rows: list[int] = []
        valid: list[int] = []
        for j, c in enumerate(members):
            rows += range(c.token_start, c.token_start + c.num_tokens)
            rows += [c.token_start] * (longest - c.num_tokens)
            valid += range(j * longest, j * longest + c.num_tokens)
        groups.append(
            FreshGroup(
                len(members),
                longest,
                device_tensor(rows, torch.int64, device),
                device_tensor(valid, torch.int64, device),
                members[0].token_start,
            )
        )
    return groups


def attend_group(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: FreshGroup, scale: float, out: torch.Tensor
) -> None:
    """Causal attention of a group's chunks over their own K/V, one batched call; writes ``out``'s rows."""
    if group.size == 1:  # no padding, no gather
        span = slice(group.start, group.start + group.length)
        out[span] = attend_causal(q[span], k[span], v[span], 0, scale)
        return
    g, n = group.size, group.length

    def batch(x: torch.Tensor) -> torch.Tensor:  # [G * L, heads, D] -> [G, heads, L, D]
        return x.index_select(0, group.rows).view(g, n, *x.shape[1:]).transpose(1, 2)

    o = causal_attention(batch(q), batch(k), batch(v), scale)
    flat = o.transpose(1, 2).reshape(g * n, *q.shape[1:])
    out.index_copy_(0, group.rows.index_select(0, group.valid), flat.index_select(0, group.valid))


def attend_causal(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_cached: int, scale: float
) -> torch.Tensor:
    """Causal attention of q [n, H, D] at positions num_cached.. over k, v [num_cached + n, KVH, D]."""
    assert k.shape[0] == num_cached + q.shape[0], (k.shape, num_cached, q.shape)
    # 4-D inputs: with a batch dim torch picks its fused (flash) CPU kernel; 3-D falls back to the math path.
    qt, kt, vt = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    return causal_attention(qt, kt, vt, scale)[0].transpose(0, 1)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention of q [B, H, n, D] over k, v [B, KVH, ctx, D] (ctx >= n), causal with the queries at the
    last n positions (bottom-right aligned: a chunk after its ``ctx - n`` cached tokens)."""
    gqa = q.shape[1] != k.shape[1]
    if _flash_applies(q, k, v, gqa):
        # FlashAttention's causal mask is bottom-right aligned when ctx > n (torch's CausalBias relies on it).
        return torch.ops.aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, is_causal=True, return_debug_mask=False, scale=scale
        )[0]
    n, ctx = q.shape[2], k.shape[2]
    if n == ctx:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    rows = torch.arange(n, device=q.device).unsqueeze(1) + (ctx - n)
    mask = torch.arange(ctx, device=q.device).unsqueeze(0) <= rows
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)


def _flash_applies(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gqa: bool) -> bool:
    """Whether FlashAttention takes these inputs as they are (CUDA, fp16/bf16, a head dim it supports) and
    gave the bottom-right causal attention on this device when checked (`_flash_checked`)."""
    if q.device.type != "cuda" or q.shape[-1] % 8:
        return False
    # Asked without the causal flag: SDPA's check refuses causal calls with more keys than queries (its own
    # mask would be top-left), while the op called here is bottom-right, which `_flash_checked` verifies.
    params = torch.backends.cuda.SDPAParams(q, k, v, None, 0.0, False, gqa)
    if not torch.backends.cuda.can_use_flash_attention(params, False):
        return False
    return _flash_checked(q.device, q.dtype, q.shape[1] // k.shape[1], q.shape[-1])


@functools.cache
def _flash_checked(device: torch.device, dtype: torch.dtype, group: int, head_dim: int) -> bool:
    """One small case through FlashAttention against SDPA with an explicit mask, once per kind of input:
    the call is torch-internal (the one its ``CausalBias`` makes), so check it rather than assume it."""

    def pairs() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        gen = torch.Generator().manual_seed(0)
        q = torch.randn(2, 2 * group, 5, head_dim, generator=gen).to(device, dtype)
        k, v = (torch.randn(2, 2, 9, head_dim, generator=gen).to(device, dtype) for _ in range(2))
        got = torch.ops.aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, is_causal=True, return_debug_mask=False, scale=0.125
        )[0]
        mask = torch.arange(9, device=device)[None] <= torch.arange(5, device=device)[:, None] + 4
        yield got, F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.125, enable_gqa=group > 1)

    return agrees_with_sdpa("FlashAttention's causal call", pairs, "fills use SDPA")


def agrees_with_sdpa(
    op: str, pairs: Callable[[], Iterable[tuple[torch.Tensor, torch.Tensor]]], fallback: str
) -> bool:
    """Whether every (``op``'s output, SDPA's) pair of a small check case is close. A mismatch, or an op
    that raises (RuntimeError; TypeError: another torch's op schema), is logged with ``fallback`` (what
    runs instead) and answers False."""
    try:
        for got, want in pairs():
            if not torch.allclose(got.float(), want.float(), rtol=2e-2, atol=2e-2):
                log.warning("%s differs from SDPA here: %s", op, fallback)
                return False
        return True
    except (RuntimeError, TypeError) as exc:
        log.warning("%s unusable here (%s): %s", op, exc, fallback)
    return False
