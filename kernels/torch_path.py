"""Fast torch form of the two-phase decode attention: the path the engine runs on CPU.

Plain paged decode gathers each chunk of sequences' blocks into a workspace and runs torch's fused CPU
attention kernel over it, with the query heads of each KV head as its query rows (GQA without repeating KV),
and a padding mask where the chunk's sequences differ in length. The chunking depends only on the block
tables and lengths, so the engine plans it once per step (`plan_decode`) and every layer reuses the plan: a
layer's decode attention is then a handful of ops (two gathers and one kernel per chunk); a lone sequence
whose blocks form one run is attended in place, with no gather at all.

Shared-prefix decode is computed as the paper's kernel does it, with library GEMMs:

* prefix pass: for each group, the prefix KV is gathered once and every KV head runs one GEMM with all of
  the group's queries (members x query heads of that KV head) as the M dimension, in key chunks merged by
  log-sum-exp, so the prefix is read once per batch instead of once per sequence;
* suffix pass: a paged pass over each sequence's private blocks (the plain paged decode routine);
* an exact log-sum-exp merge of the two partials.

CPU decode is memory bound and the allocator is a large part of the bill: a fresh multi-megabyte tensor
costs page faults on every call (measured 4x slower than reusing one). So gathers, scores and outputs live
in per-thread workspaces that are reused across calls, and work is chunked so that each workspace stays
around a few megabytes (cache resident) instead of growing with batch x context.

Accumulation is float32 whatever the cache dtype (the fused kernel's, and the prefix pass's float32 math);
results are cast back to ``q.dtype``.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field

import torch

from kernels import cpu_linear
from kernels.device_tensors import device_tensor

__all__ = [
    "DecodePlan",
    "merge_attention_states",
    "paged_decode_attention",
    "paged_decode_partial",
    "plan_decode",
    "shared_prefix_decode_attention",
]

# Gathered key bytes per chunk of the paged pass, and score elements per chunk of the prefix pass. Both keep
# the working set cache resident while leaving each kernel call big enough to run at full speed (paged pass:
# 2 MiB of keys, plus as much of values, measured fastest of 1-16 MiB for batches of 16 and 64 on 2 cores).
# Prefix passes with fewer query rows than _PREFIX_MIN_GEMM_ROWS or fewer score elements than
# _PREFIX_MIN_GEMM_ELEMS take the batched small-problem form (measured crossover on 2 cores, fp32, d128).
_PAGED_CHUNK_BYTES = 2 << 20
_PREFIX_CHUNK_ELEMS = 1 << 19
_PREFIX_MIN_GEMM_ROWS = 64
_PREFIX_MIN_GEMM_ELEMS = 1 << 16

_softmax_out = torch.ops.aten._softmax.out


class _Workspace(threading.local):
    """Per-thread scratch buffers, grown on demand and reused: one flat tensor per (name, dtype, device)."""

    def __init__(self) -> None:
        self.buffers: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = {}

    def get(
        self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        numel = math.prod(shape)
        key = (name, dtype, device)
        buf = self.buffers.get(key)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(numel, dtype=dtype, device=device)
            self.buffers[key] = buf
        return buf[:numel].view(shape)


_ws = _Workspace()


def _gemm_nt(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w.T`` for contiguous float32 ``x [M, K]`` and ``w [N, K]``."""
    return cpu_linear.linear(x, w)


def _gemm_nn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w`` for contiguous float32 ``x [M, K]`` and ``w [K, N]``."""
    return cpu_linear.onednn_linear(x, w.t()) if cpu_linear.use_onednn(x) else torch.mm(x, w)


def _softmax_with_lse(scores: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """Write ``softmax(scores)`` over the last dim into ``probs``; return the natural-log LSE ``[..., 1]``.

    ``probs`` may be ``scores`` itself (in place).

    torch's softmax is one fused pass (max, exp, sum, scale) but does not return the normaliser. It is
    recovered from the largest probability: ``max p = exp(m - lse)``, so ``lse = m - log(max p)``, and
    ``max p >= 1 / n`` keeps the log well conditioned. Two cheap row reductions instead of an exp pass.
    """
    row_max = scores.amax(dim=-1, keepdim=True)
    _softmax_out(scores, -1, False, out=probs)
    return row_max - probs.amax(dim=-1, keepdim=True).log()


def _merge_into(
    acc: torch.Tensor, acc_lse: torch.Tensor, part: torch.Tensor, part_lse: torch.Tensor
) -> torch.Tensor:
    """Fold a non-empty partial ``(part, part_lse)`` into ``(acc, acc_lse)`` in place; returns the new LSE.

    ``acc_lse``/``part_lse`` carry a trailing singleton dim so they broadcast over head_dim. ``acc`` may be
    empty (``-inf``, output zeros), then it is replaced. ``part`` is only read (it may be a strided view).
    """
    new_lse = torch.logaddexp(acc_lse, part_lse)
    acc.mul_(torch.exp(acc_lse - new_lse)).addcmul_(part, torch.exp(part_lse - new_lse))
    return new_lse


def _scaled_queries(q: torch.Tensor, scale: float) -> torch.Tensor:
    """``q * scale`` in float32, in a workspace (the scale is folded into the queries, not the scores)."""
    return torch.mul(q, scale, out=_ws.get("q", tuple(q.shape), torch.float32, q.device))


@dataclass(frozen=True)
class _PlanChunk:
    """Sequences whose blocks are gathered and attended together."""

    rows: torch.Tensor | None  # [count] int64 batch rows; None: every row of the batch, in order
    table: torch.Tensor  # [count * nblk] int64 block ids to gather (padding slots clamped to a real block)
    count: int
    nblk: int
    length: int  # the longest member's tokens (attended keys: a prefix of the gathered ones)
    pad_lens: torch.Tensor | None  # [count, 1] int64 member lengths when they differ (masked), else None
    # A lone sequence whose blocks are consecutive in the cache (the allocator hands out runs, so usual at
    # batch 1) is attended in place, from this first block, with no gather.
    first_block: int | None = None


@dataclass
class DecodePlan:
    """How a decode batch is cut into gather-and-attend chunks: the same for every layer of a step, so the
    engine builds it once per step (`plan_decode`) instead of once per layer."""

    batch: int
    block_size: int
    chunks: list[_PlanChunk]
    complete: bool  # one chunk covering every row in order (its output is the result, nothing scattered)
    masks: dict[torch.dtype, list[torch.Tensor | None]] = field(default_factory=dict)

    def mask(self, i: int, dtype: torch.dtype) -> torch.Tensor | None:
        """Chunk ``i``'s additive padding mask (0 / -inf, ``[count, 1, 1, length]``), made once per dtype."""
        masks = self.masks.get(dtype)
        if masks is None:
            masks = [_additive_mask(c, dtype) for c in self.chunks]
            self.masks[dtype] = masks
        return masks[i]


def _additive_mask(chunk: _PlanChunk, dtype: torch.dtype) -> torch.Tensor | None:
    if chunk.pad_lens is None:
        return None
    keys = torch.arange(chunk.length, device=chunk.pad_lens.device)
    pad = keys[None, :] >= chunk.pad_lens
    mask = torch.zeros(pad.shape, dtype=dtype, device=pad.device).masked_fill_(pad, -math.inf)
    return mask.view(chunk.count, 1, 1, chunk.length)


def plan_decode(block_tables: torch.Tensor, context_lens: torch.Tensor, k_cache: torch.Tensor) -> DecodePlan:
    """Chunk a decode batch for `paged_decode_partial`: sequences in order when they all fit one gather
    workspace, else in ascending length (so that sequences chunked together pad little), each chunk within
    ``_PAGED_CHUNK_BYTES`` of gathered keys; empty sequences in none."""
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    device = block_tables.device
    lens = [int(n) for n in context_lens.tolist()]
    batch = len(lens)
    live = [b for b in range(batch) if lens[b] > 0]
    token_bytes = num_kv_heads * head_dim * k_cache.element_size()
    budget_tokens = max(1, _PAGED_CHUNK_BYTES // token_bytes)

    def padded(n: int) -> int:
        return -(-n // block_size) * block_size

    if live and len(live) * padded(max(lens)) <= budget_tokens:
        groups = [live]
    else:
        order = sorted(live, key=lens.__getitem__)
        groups, start = [], 0
        while start < len(order):
            # Grow the chunk while (sequences x padded length) fits the budget; at least one sequence.
            stop = start + 1
            while stop < len(order) and (stop - start + 1) * padded(lens[order[stop]]) <= budget_tokens:
                stop += 1
            groups.append(order[start:stop])
            start = stop
    # Table slots past a sequence's own length may hold junk; clamp them to a real block (never attended).
    tables = block_tables.long().clamp(0, num_blocks - 1)
    chunks = []
    for idx in groups:
        length = max(lens[b] for b in idx)
        nblk = -(-length // block_size)
        everything = idx == list(range(batch))
        rows = None if everything else device_tensor(idx, torch.long, device)
        table = (tables if rows is None else tables.index_select(0, rows))[:, :nblk].reshape(-1)
        uneven = any(lens[b] != length for b in idx)
        pad_lens = device_tensor([[lens[b]] for b in idx], torch.long, device) if uneven else None
        first = None
        if len(idx) == 1:
            blocks = table.tolist()
            first = blocks[0] if blocks == list(range(blocks[0], blocks[0] + nblk)) else None
        chunks.append(_PlanChunk(rows, table, len(idx), nblk, length, pad_lens, first))
    complete = len(chunks) == 1 and chunks[0].rows is None
    return DecodePlan(batch, block_size, chunks, complete)


def _flash(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention with its log-sum-exp: ``q [B, Hkv, G, D]`` (the G query heads of each KV head as its query
    rows: GQA with no repeated KV), ``k``/``v`` ``[B, Hkv, L, D]`` (any strides with a unit last stride),
    ``mask`` additive ``[B, 1, 1, L]`` or None. Returns ``(out [B, Hkv, G, D] in q's dtype, lse [B, Hkv, G]
    float32)``.

    On CPU, torch's fused flash kernel: one pass over the keys with an online softmax and float32
    accumulation, no score tensor in memory, a handful of ops per call where the GEMM form takes ~20 (the
    engine calls it once per layer per step, so per-op cost matters as much as bandwidth). Elsewhere (the
    torch path on CUDA without triton) the same in plain ops, in float32.
    """
    if q.device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, False, attn_mask=mask, scale=scale
        )
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)).mul_(scale)
    if mask is not None:
        scores.add_(mask.float())
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.matmul(torch.exp(scores - lse[..., None]), v.float())
    return out.to(q.dtype), lse


def _paged_pass(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: DecodePlan,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every sequence over its own blocks: ``(out [B, H, D] in the compute dtype, lse [B, H] float32)``;
    an empty sequence gets 0 and ``-inf``."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    # The fused kernel wants one dtype throughout; a cache in another dtype (mixed-precision callers) is
    # attended in float32.
    dtype = q.dtype if q.dtype == k_cache.dtype == v_cache.dtype else torch.float32
    q4 = q.to(dtype).view(batch, num_kv_heads, group, head_dim)
    if plan.complete:
        out, lse = _paged_chunk(q4, k_cache, v_cache, plan, 0, dtype, scale)
        # (the kernel lays its results out query-row-major: a small re-layout copy)
        return out.reshape(batch, num_heads, head_dim), lse.reshape(batch, num_heads)
    out = torch.zeros(batch, num_heads, head_dim, dtype=dtype, device=q.device)
    lse = torch.full((batch, num_heads), -math.inf, dtype=torch.float32, device=q.device)
    for i, chunk in enumerate(plan.chunks):
        qc = q4 if chunk.rows is None else q4.index_select(0, chunk.rows)
        o, part_lse = _paged_chunk(qc, k_cache, v_cache, plan, i, dtype, scale)
        rows = chunk.rows if chunk.rows is not None else torch.arange(batch, device=q.device)
        out.index_copy_(0, rows, o.reshape(chunk.count, num_heads, head_dim))
        lse.index_copy_(0, rows, part_lse.reshape(chunk.count, num_heads))
    return out, lse


def _paged_chunk(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: DecodePlan,
    i: int,
    dtype: torch.dtype,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunk ``i`` of the plan: gather its blocks into a reused workspace (unless they are one run of
    blocks), attend ``q [count, Hkv, G, D]``."""
    chunk = plan.chunks[i]
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    if chunk.first_block is not None:
        k = k_cache[chunk.first_block : chunk.first_block + chunk.nblk]
        v = v_cache[chunk.first_block : chunk.first_block + chunk.nblk]
    else:
        shape = (chunk.count * chunk.nblk, block_size, num_kv_heads, head_dim)
        k = torch.index_select(k_cache, 0, chunk.table, out=_ws.get("k", shape, k_cache.dtype, q.device))
        v = torch.index_select(v_cache, 0, chunk.table, out=_ws.get("v", shape, v_cache.dtype, q.device))
    # [count, Hkv, keys, D] views of the blocks, cut to the longest member (shorter ones masked).
    keys = (chunk.count, chunk.nblk * block_size, num_kv_heads, head_dim)
    k = k.view(keys)[:, : chunk.length].transpose(1, 2).to(dtype)
    v = v.view(keys)[:, : chunk.length].transpose(1, 2).to(dtype)
    return _flash(q, k, v, plan.mask(i, dtype), scale)


def paged_decode_partial(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    plan: DecodePlan | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Paged decode attention returning the partial state (normalised output and its log-sum-exp).

    Returns ``(out [B, H, D] float32, lse [B, H] float32)``; a sequence with no tokens gets 0 and ``-inf``.
    ``plan``: `plan_decode` of these tables and lengths, when the caller keeps one across layers.
    """
    plan = plan or plan_decode(block_tables, context_lens, k_cache)
    out, lse = _paged_pass(q, k_cache, v_cache, plan, scale)
    return out.float(), lse


def _gather_head_major(cache: torch.Tensor, table: torch.Tensor, name: str) -> torch.Tensor:
    """The blocks ``table`` of ``cache`` as float32 ``[num_kv_heads, len(table) * block_size, head_dim]``.

    A float32 cache is gathered straight into that layout, one head at a time (one pass over the data; a
    gather then a transposing copy is two); other dtypes are gathered, then converted by that copy.
    """
    _, block_size, num_kv_heads, head_dim = cache.shape
    nblk = table.numel()
    out = _ws.get(name, (num_kv_heads, nblk, block_size, head_dim), torch.float32, cache.device)
    if cache.dtype == torch.float32:
        for h in range(num_kv_heads):
            torch.index_select(cache[:, :, h], 0, table, out=out[h])
    else:
        staging = _ws.get(name + "g", (nblk, block_size, num_kv_heads, head_dim), cache.dtype, cache.device)
        gathered = torch.index_select(cache, 0, table, out=staging)
        out.copy_(gathered.permute(2, 0, 1, 3))
    return out.view(num_kv_heads, nblk * block_size, head_dim)


def _prefix_partial(
    q_rows: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    prefix_table: torch.Tensor,
    prefix_len: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """All of one group's queries over its prefix: ``q_rows [Hkv, M, D]`` (scaled, float32).

    Returns ``(out [Hkv, M, D], lse [Hkv, M, 1])``; ``prefix_len > 0``.
    """
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    device = q_rows.device
    rows = q_rows.shape[1]
    nblk = -(-prefix_len // block_size)
    table = prefix_table[:nblk].long()
    # Either way the prefix KV is gathered once per group (never per sequence).
    if rows < _PREFIX_MIN_GEMM_ROWS or rows * prefix_len < _PREFIX_MIN_GEMM_ELEMS:
        # Small: a handful of batched ops over all heads beats per-head GEMM calls (fixed costs dominate).
        kv_shape = (nblk, block_size, num_kv_heads, head_dim)
        k = torch.index_select(k_cache, 0, table, out=_ws.get("pk", kv_shape, k_cache.dtype, device))
        v = torch.index_select(v_cache, 0, table, out=_ws.get("pv", kv_shape, v_cache.dtype, device))
        k = k.view(nblk * block_size, num_kv_heads, head_dim)[:prefix_len]
        v = v.view(nblk * block_size, num_kv_heads, head_dim)[:prefix_len]
        shape = (num_kv_heads, rows, prefix_len)
        scores = _ws.get("ps", shape, torch.float32, device)
        probs = _ws.get("pp", shape, torch.float32, device)
        torch.bmm(q_rows, k.float().permute(1, 2, 0), out=scores)
        lse = _softmax_with_lse(scores, probs)
        out = _ws.get("po", (num_kv_heads, rows, head_dim), torch.float32, device)
        return torch.bmm(probs, v.float().transpose(0, 1), out=out), lse

    # Large: K and V gathered head-major in float32, so that each head's keys and values are contiguous
    # [P, D] matrices, the operand layout the fast GEMMs need; key chunks keep one head's [M, chunk] scores
    # in cache between the QK GEMM, the softmax and the PV GEMM, and are merged by log-sum-exp.
    k_heads = _gather_head_major(k_cache, table, "pkh")
    v_heads = _gather_head_major(v_cache, table, "pvh")
    chunk = min(prefix_len, max(256, _PREFIX_CHUNK_ELEMS // rows))
    out = _ws.get("po", (num_kv_heads, rows, head_dim), torch.float32, device)
    lse = torch.empty(num_kv_heads, rows, 1, dtype=torch.float32, device=device)
    for h in range(num_kv_heads):
        acc, acc_lse = out[h], None
        for lo in range(0, prefix_len, chunk):
            hi = min(prefix_len, lo + chunk)
            scores = _gemm_nt(q_rows[h], k_heads[h, lo:hi])
            # In place: the scores are a fresh GEMM output, and one buffer less keeps the chunk in cache.
            part_lse = _softmax_with_lse(scores, scores)
            part = _gemm_nn(scores, v_heads[h, lo:hi])
            if acc_lse is None:
                acc.copy_(part)
                acc_lse = part_lse
            else:
                acc_lse = _merge_into(acc, acc_lse, part, part_lse)
        assert acc_lse is not None
        lse[h] = acc_lse
    return out, lse


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    plan: DecodePlan | None = None,
) -> torch.Tensor:
    """Paged decode attention (torch path); see :func:`kernels.paged_decode_attention`. ``plan`` as in
    `paged_decode_partial`."""
    plan = plan or plan_decode(block_tables, context_lens, k_cache)
    out, _ = _paged_pass(q, k_cache, v_cache, plan, scale)
    return out.to(q.dtype)


def shared_prefix_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    prefix_block_tables: torch.Tensor,
    prefix_lens: torch.Tensor,
    group_of: torch.Tensor,
    suffix_block_tables: torch.Tensor,
    suffix_lens: torch.Tensor,
    scale: float,
    *,
    plan: DecodePlan | None = None,
    suffix: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Shared-prefix decode attention (torch path); see :func:`kernels.shared_prefix_decode_attention`.
    ``plan``: `plan_decode` of the suffix tables and lengths, when the caller keeps one across layers;
    ``suffix``: the suffix pass's partial (float32 out, lse), when the caller computed it another way (the
    C++ kernel); it is merged into in place."""
    _, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    out, lse = suffix or paged_decode_partial(
        q, k_cache, v_cache, suffix_block_tables, suffix_lens, scale, plan=plan
    )

    groups = [int(g) for g in group_of.tolist()]
    plens = [int(n) for n in prefix_lens.tolist()]
    members: dict[int, list[int]] = {}
    for b, g in enumerate(groups):
        if g >= 0 and plens[g] > 0:
            members.setdefault(g, []).append(b)
    if not members:
        return out.to(q.dtype)
    qs = _scaled_queries(q, scale)

    for g, mem in members.items():
        idx = device_tensor(mem, torch.long, q.device)
        n = len(mem)
        # Rows of the GEMM: (member, query head of this KV head), member-major, one row block per KV head.
        q_rows = _ws.get("qr", (num_kv_heads, n, group, head_dim), torch.float32, q.device)
        q_rows.copy_(qs.index_select(0, idx).view(n, num_kv_heads, group, head_dim).transpose(0, 1))
        q_rows = q_rows.view(num_kv_heads, n * group, head_dim)
        p_out, p_lse = _prefix_partial(q_rows, k_cache, v_cache, prefix_block_tables[g], plens[g])
        # Merge in place into the members' suffix partials, viewed [n, Hkv, G, ...] to match the prefix rows
        # without copying them (fresh megabyte temporaries cost page faults on every call).
        contiguous = mem == list(range(mem[0], mem[0] + n))
        rows_out = out[mem[0] : mem[0] + n] if contiguous else out.index_select(0, idx)
        rows_lse = lse[mem[0] : mem[0] + n] if contiguous else lse.index_select(0, idx)
        new_lse = _merge_into(
            rows_out.view(n, num_kv_heads, group, head_dim),
            rows_lse.view(n, num_kv_heads, group, 1),
            p_out.view(num_kv_heads, n, group, head_dim).permute(1, 0, 2, 3),
            p_lse.view(num_kv_heads, n, group, 1).permute(1, 0, 2, 3),
        )
        rows_lse.copy_(new_lse.view(n, num_heads))
        if not contiguous:
            out.index_copy_(0, idx, rows_out)
            lse.index_copy_(0, idx, rows_lse)
    return out.to(q.dtype)


def merge_attention_states(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact LSE merge of two partials in float32 (torch path); see :func:`kernels.merge_attention_states`."""
    la, lb = lse_a.float(), lse_b.float()
    m = torch.maximum(la, lb)
    # Both empty: m = -inf; use 0 as the reference point so that the weights come out 0, not NaN.
    m = torch.where(m == -math.inf, torch.zeros_like(m), m)
    wa, wb = torch.exp(la - m), torch.exp(lb - m)
    total = wa + wb
    safe = torch.where(total > 0, total, torch.ones_like(total))
    wa, wb = (wa / safe)[..., None], (wb / safe)[..., None]
    # An empty partial's output is ignored whatever it holds (it may be uninitialised memory).
    out = torch.where(wa > 0, out_a.float() * wa, 0.0) + torch.where(wb > 0, out_b.float() * wb, 0.0)
    lse = torch.where(total > 0, m + torch.log(safe), torch.full_like(m, -math.inf))
    return out.to(out_a.dtype), lse
