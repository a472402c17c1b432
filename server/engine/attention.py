"""Attention over the paged KV cache: the metadata a step needs and the backend that computes it.

One step's tokens are flattened with no padding: first one token per decoding sequence, then each fill chunk.
Prefill attends over [cached tokens of the context + the chunk] causally; decode goes through `kernels`
(Triton on CUDA, the torch form of the same two-phase algorithm on CPU), with sequences that share an
ancestor context grouped so the shared prefix is read once for the whole group. On CPU decode runs our C++
kernel over the block cache (`kernels.cpu_kernels`) where it could be built; otherwise the torch path, with
its chunking planned by the step's first layer and kept on the `DecodeBatch` for the others.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

import kernels
from kernels import cpu_kernels, torch_path
from kernels.device_tensors import device_tensor
from server.engine import paged_prefill
from server.engine.fresh_plan import FreshPlan, attend_fresh, plan_fresh
from server.engine.fresh_prefill import attend_causal
from server.engine.prefill_rows import MAX_CONTEXT, PrefillRows, prefill_rows


@dataclass
class PrefillChunk:
    """A run of ``num_tokens`` new tokens of one context, after ``num_cached`` tokens already in the cache."""

    token_start: int
    num_tokens: int
    num_cached: int
    block_table: torch.Tensor  # [blocks] int64, covering num_cached + num_tokens positions


@dataclass
class SharedPrefixGroups:
    """Decode sequences grouped by shared prefix blocks (see `kernels.shared_prefix_decode_attention`)."""

    prefix_block_tables: torch.Tensor  # [G, max_prefix_blocks] int32
    prefix_lens: torch.Tensor  # [G] int32
    group_of: torch.Tensor  # [B] int32, -1 for a sequence outside every group
    suffix_block_tables: torch.Tensor  # [B, max_suffix_blocks] int32
    suffix_lens: torch.Tensor  # [B] int32


@dataclass
class DecodeBatch:
    """One query token per sequence, at batch rows [0, num_seqs)."""

    block_tables: torch.Tensor  # [B, max_blocks] int32
    context_lens: torch.Tensor  # [B] int32, including the token being decoded
    groups: SharedPrefixGroups | None = None
    # CPU: how the torch path chunks this batch, the same in every layer: made by the first, reused after.
    plan: torch_path.DecodePlan | None = None

    @property
    def num_seqs(self) -> int:
        return int(self.context_lens.shape[0])


class RemoteAttention(Protocol):
    """Rows of a step whose context starts with KV on another engine (`remote_kv.RemoteRows`)."""

    def attend(
        self,
        layer: int,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        scale: float,
        out: torch.Tensor,
    ) -> None:
        """Write these rows' attention, over their local and their remote keys, into ``out``."""
        ...


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: cache slot (block * block_size + offset) of each new token
    decode: DecodeBatch | None  # rows [0, decode.num_seqs)
    prefills: list[PrefillChunk]
    # Rows of contexts that start with KV on another engine (`server.engine.remote_kv`); None: no such row.
    remote: RemoteAttention | None = None
    # How the fill chunks with nothing cached are batched (`plan_fresh`): made by the first layer.
    fresh: FreshPlan | None = None
    # CPU: the fill chunks as rows of the decode kernel (`prefill_rows`), made by the first layer; None
    # until then, False where they cannot be.
    fill_rows: PrefillRows | bool | None = None


class AttentionBackend(Protocol):
    """Computes attention for one layer once the step's new K/V are in the cache."""

    def __call__(
        self,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, KVH, D]: the step's new keys (already written to the cache too)
        v: torch.Tensor,
        k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        layer: int,  # which layer: what a remote KV holder attends over
    ) -> torch.Tensor: ...


class PagedAttentionBackend:
    """The default backend: torch prefill, `kernels` decode (dispatching by device). On CPU, fill chunks
    whose context is at most ``fill_rows_reach`` tokens attend as rows of the decode kernel (`prefill_rows`;
    `EVERY_CHUNK`: all of them, as `EngineConfig.batch_invariant` needs)."""

    def __init__(self, fill_rows_reach: int = MAX_CONTEXT) -> None:
        self.fill_rows_reach = fill_rows_reach

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        layer: int,
    ) -> torch.Tensor:
        if meta.decode is not None and not meta.prefills and meta.remote is None:
            return _decode(q, k_cache, v_cache, meta.decode, scale)  # a pure decode step: the whole output
        out = torch.empty_like(q)
        if meta.remote is not None:
            meta.remote.attend(layer, q, k_cache, v_cache, scale, out)
        if meta.decode is not None:
            n = meta.decode.num_seqs
            out[:n] = _decode(q[:n], k_cache, v_cache, meta.decode, scale)
        done = (
            _fill_by_rows(q, k_cache, v_cache, meta, scale, out, self.fill_rows_reach)
            if meta.prefills
            else frozenset()
        )
        if meta.fresh is None:
            meta.fresh = plan_fresh(
                [c for i, c in enumerate(meta.prefills) if c.num_cached == 0 and i not in done], q, k
            )
        attend_fresh(q, k, v, meta.fresh, scale, out)  # nothing before these chunks: their own K/V only
        for i, chunk in enumerate(meta.prefills):
            if chunk.num_cached > 0 and i not in done:
                rows = slice(chunk.token_start, chunk.token_start + chunk.num_tokens)
                out[rows] = _prefill(q[rows], k_cache, v_cache, chunk, scale)
        return out


def _fill_by_rows(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    out: torch.Tensor,
    reach: int,
) -> frozenset[int]:
    """On CPU, the step's fill chunks whose context is at most ``reach`` tokens in one call of our decode
    kernel (`prefill_rows`); returns which chunks it attended (none where the kernel does not run these
    shapes)."""
    native = _cpu_decode_kernel(q, k_cache)
    if native is None or meta.fill_rows is False:
        return frozenset()
    if meta.fill_rows is None:
        meta.fill_rows = prefill_rows(meta.prefills, reach) or False
    if not isinstance(meta.fill_rows, PrefillRows):
        return frozenset()
    r = meta.fill_rows
    attended = native(q[r.rows], k_cache, v_cache, r.block_tables, r.context_lens, scale)[0]
    if isinstance(r.rows, slice):
        out[r.rows] = attended
    else:
        out.index_copy_(0, r.rows, attended.to(out.dtype))
    return r.chunks


def _cpu_decode_kernel(q: torch.Tensor, k_cache: torch.Tensor) -> cpu_kernels.PartialAttention | None:
    """Our C++ decode kernel where it runs these shapes vectorised (CPU tensors), else None."""
    if q.device.type != "cpu":
        return None
    native = cpu_kernels.paged_decode_kernel()
    if native is None or not cpu_kernels.decode_kernel_covers(
        q.shape[1], k_cache.shape[2], k_cache.shape[3], k_cache.shape[1]
    ):
        return None
    return native


def _decode(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: DecodeBatch, scale: float
) -> torch.Tensor:
    g = batch.groups
    if q.device.type == "cpu":
        return _decode_cpu(q, k_cache, v_cache, batch, scale)
    if g is None:
        return kernels.paged_decode_attention(
            q, k_cache, v_cache, batch.block_tables, batch.context_lens, scale
        )
    return kernels.shared_prefix_decode_attention(
        q,
        k_cache,
        v_cache,
        g.prefix_block_tables,
        g.prefix_lens,
        g.group_of,
        g.suffix_block_tables,
        g.suffix_lens,
        scale,
    )


def _decode_cpu(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: DecodeBatch, scale: float
) -> torch.Tensor:
    """Our C++ kernel over the block cache where it is built (`kernels.cpu_kernels`), else the torch path
    with its chunking planned once per step; shared prefixes through the torch path's prefix pass."""
    g = batch.groups
    tables, lens = (
        (batch.block_tables, batch.context_lens) if g is None else (g.suffix_block_tables, g.suffix_lens)
    )
    native = _cpu_decode_kernel(q, k_cache)
    suffix = None
    if native is not None:
        suffix = native(q, k_cache, v_cache, tables, lens, scale)
        if g is None:
            return suffix[0].to(q.dtype)
    elif batch.plan is None:
        batch.plan = torch_path.plan_decode(tables, lens, k_cache)
    if g is None:
        return torch_path.paged_decode_attention(q, k_cache, v_cache, tables, lens, scale, plan=batch.plan)
    return torch_path.shared_prefix_decode_attention(
        q,
        k_cache,
        v_cache,
        g.prefix_block_tables,
        g.prefix_lens,
        g.group_of,
        tables,
        lens,
        scale,
        plan=batch.plan,
        suffix=suffix,
    )


def _prefill(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, chunk: PrefillChunk, scale: float
) -> torch.Tensor:
    if paged_prefill.enabled(q.device):
        return paged_prefill.attend(q, k_cache, v_cache, chunk, scale)
    return gathered_prefill(q, k_cache, v_cache, chunk, scale)


def gathered_prefill(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, chunk: PrefillChunk, scale: float
) -> torch.Tensor:
    """A chunk after cached tokens: its context gathered out of the cache, then causal SDPA over the copy."""
    ctx = chunk.num_cached + chunk.num_tokens
    kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    # Only the written positions [0, ctx) are gathered: no unwritten slot is ever attended.
    k = k_cache[chunk.block_table].reshape(-1, kv_heads, head_dim)[:ctx]
    v = v_cache[chunk.block_table].reshape(-1, kv_heads, head_dim)[:ctx]
    return attend_causal(q, k, v, chunk.num_cached, scale)


def pad_tables(tables: list[list[int]], device: torch.device) -> torch.Tensor:
    """Block tables as one ``[len(tables), widest]`` int32 tensor, padded with block 0 (never read: every
    reader is bounded by a length)."""
    width = max(1, max(len(t) for t in tables))
    return device_tensor([t + [0] * (width - len(t)) for t in tables], torch.int32, device)
