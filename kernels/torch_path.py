"""Fast torch form of the two-phase decode attention: the path the engine runs on CPU.

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

All math is float32 whatever the cache dtype; results are cast back to ``q.dtype``.
"""

from __future__ import annotations

import functools
import math
import threading

import torch

__all__ = [
    "merge_attention_states",
    "paged_decode_attention",
    "paged_decode_partial",
    "shared_prefix_decode_attention",
]

# Gathered tokens per chunk of the paged pass, and score elements per chunk of the prefix pass. Both keep the
# working set near the size of a last-level cache while leaving each GEMM big enough to run at full speed.
# Prefix passes with fewer query rows than _PREFIX_MIN_GEMM_ROWS or fewer score elements than
# _PREFIX_MIN_GEMM_ELEMS take the batched small-problem form (measured crossover on 2 cores, fp32, d128).
_PAGED_CHUNK_BYTES = 4 << 20
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


def _mkldnn_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")


@functools.cache
def _mkldnn_usable() -> bool:
    """Whether oneDNN's fp32 linear is usable and exact here, for both operand layouts the GEMM helpers pass
    (it is torch-internal: check, not assume)."""
    try:
        x, w = torch.randn(5, 32), torch.randn(40, 32)
        nt = torch.allclose(_mkldnn_linear(x, w), x @ w.t(), rtol=1e-5, atol=1e-5)
        v = torch.randn(32, 40)
        nn = torch.allclose(_mkldnn_linear(x, v.t()), x @ v, rtol=1e-5, atol=1e-5)
        return nt and nn
    except Exception:  # missing op, torch built without oneDNN, ...
        return False


def _use_mkldnn(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and x.dtype == torch.float32 and _mkldnn_usable()


# On CPU, torch.mm goes to MKL, which on some x86 parts (AMD EPYC here) runs only its AVX2 kernels: ~170
# GFLOP/s on 2 cores, where oneDNN's linear uses AVX-512 and runs these shapes (a few hundred rows against
# thousands of keys, head_dim 128) at 330-420. oneDNN reads the weight either row-major or as the transpose
# of a row-major matrix; any other stride (a head sliced out of a [tokens, heads, dim] tensor) takes a path
# a thousand times slower, so the callers pass contiguous per-head matrices.


def _gemm_nt(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w.T`` for contiguous float32 ``x [M, K]`` and ``w [N, K]``."""
    return _mkldnn_linear(x, w) if _use_mkldnn(x) else torch.mm(x, w.t())


def _gemm_nn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w`` for contiguous float32 ``x [M, K]`` and ``w [K, N]``."""
    return _mkldnn_linear(x, w.t()) if _use_mkldnn(x) else torch.mm(x, w)


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


def paged_decode_partial(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    scaled_q: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Paged decode attention returning the partial state (normalised output and its log-sum-exp).

    Returns ``(out [B, H, D] float32, lse [B, H] float32)``; a sequence with no tokens gets 0 and ``-inf``.
    ``scaled_q`` (``q * scale`` in float32) may be passed when the caller already has it.
    """
    batch, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    device = q.device
    out = torch.zeros(batch, num_heads, head_dim, dtype=torch.float32, device=device)
    lse = torch.full((batch, num_heads), -math.inf, dtype=torch.float32, device=device)

    lens = [int(n) for n in context_lens.tolist()]
    # Ascending length, so that sequences chunked together pad little.
    order = sorted((b for b in range(batch) if lens[b] > 0), key=lens.__getitem__)
    if not order:
        return out, lse
    qs = (scaled_q if scaled_q is not None else _scaled_queries(q, scale)).view(
        batch, num_kv_heads, group, head_dim
    )
    token_bytes = num_kv_heads * head_dim * max(k_cache.element_size(), 4)
    budget_tokens = max(1, _PAGED_CHUNK_BYTES // token_bytes)

    start = 0
    while start < len(order):
        # Grow the chunk while (sequences x padded length) fits the budget; at least one sequence.
        stop = start + 1
        while stop < len(order):
            padded = -(-lens[order[stop]] // block_size) * block_size
            if (stop - start + 1) * padded > budget_tokens:
                break
            stop += 1
        idx = order[start:stop]
        _paged_chunk(qs, k_cache, v_cache, block_tables, lens, idx, out, lse)
        start = stop
    return out, lse


def _paged_chunk(
    qs: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    lens: list[int],
    idx: list[int],
    out: torch.Tensor,
    lse: torch.Tensor,
) -> None:
    """Attention of the sequences ``idx`` (all non-empty) over their blocks, written into ``out``/``lse``."""
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    group = qs.shape[2]
    device = qs.device
    count = len(idx)
    max_len = max(lens[b] for b in idx)
    nblk = -(-max_len // block_size)
    padded = nblk * block_size
    idx_t = torch.tensor(idx, dtype=torch.long, device=device)

    # Table slots past a sequence's own length may hold padding; clamp them to a real block (masked below).
    table = block_tables.index_select(0, idx_t)[:, :nblk].long().clamp_(0, num_blocks - 1).reshape(-1)
    kv_shape = (count * nblk, block_size, num_kv_heads, head_dim)
    k = torch.index_select(k_cache, 0, table, out=_ws.get("k", kv_shape, k_cache.dtype, device))
    v = torch.index_select(v_cache, 0, table, out=_ws.get("v", kv_shape, v_cache.dtype, device))
    k = k.float().view(count, padded, num_kv_heads, head_dim)
    v = v.float().view(count, padded, num_kv_heads, head_dim)
    q_chunk = qs.index_select(0, idx_t)  # [count, Hkv, G, D]

    # Batched GEMMs need one batch stride: loop over whichever of (sequences, KV heads) is shorter and batch
    # the other — no repeated KV is ever materialised for GQA.
    by_head = count >= num_kv_heads
    score_shape = (num_kv_heads, count, group, padded) if by_head else (count, num_kv_heads, group, padded)
    scores = _ws.get("s", score_shape, torch.float32, device)
    probs = _ws.get("p", score_shape, torch.float32, device)
    o_shape = (num_kv_heads, count, group, head_dim) if by_head else (count, num_kv_heads, group, head_dim)
    o = _ws.get("o", o_shape, torch.float32, device)
    if by_head:
        for h in range(num_kv_heads):
            torch.bmm(q_chunk[:, h], k[:, :, h].transpose(1, 2), out=scores[h])
    else:
        for i in range(count):
            torch.bmm(q_chunk[i], k[i].permute(1, 2, 0), out=scores[i])

    chunk_lens = [lens[b] for b in idx]
    if min(chunk_lens) < padded:
        pad = torch.arange(padded, device=device)[None, :] >= torch.tensor(chunk_lens, device=device)[:, None]
        scores.masked_fill_(pad[None, :, None, :] if by_head else pad[:, None, None, :], -math.inf)
    part_lse = _softmax_with_lse(scores, probs)

    if by_head:
        for h in range(num_kv_heads):
            torch.bmm(probs[h], v[:, :, h], out=o[h])
        # Scatter straight into a head-major view of the result: no re-layout copy.
        out.view(-1, num_kv_heads, group, head_dim).transpose(0, 1).index_copy_(1, idx_t, o)
        lse.view(-1, num_kv_heads, group).transpose(0, 1).index_copy_(1, idx_t, part_lse.squeeze(-1))
    else:
        for i in range(count):
            torch.bmm(probs[i], v[i].transpose(0, 1), out=o[i])
        out.index_copy_(0, idx_t, o.view(count, -1, head_dim))
        lse.index_copy_(0, idx_t, part_lse.view(count, -1))


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
) -> torch.Tensor:
    """Paged decode attention (torch path); see :func:`kernels.paged_decode_attention`."""
    out, _ = paged_decode_partial(q, k_cache, v_cache, block_tables, context_lens, scale)
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
) -> torch.Tensor:
    """Shared-prefix decode attention (torch path); see :func:`kernels.shared_prefix_decode_attention`."""
    _, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    qs = _scaled_queries(q, scale)
    out, lse = paged_decode_partial(q, k_cache, v_cache, suffix_block_tables, suffix_lens, scale, scaled_q=qs)

    groups = [int(g) for g in group_of.tolist()]
    plens = [int(n) for n in prefix_lens.tolist()]
    members: dict[int, list[int]] = {}
    for b, g in enumerate(groups):
        if g >= 0 and plens[g] > 0:
            members.setdefault(g, []).append(b)
    if not members:
        return out.to(q.dtype)

    for g, mem in members.items():
        idx = torch.tensor(mem, dtype=torch.long, device=q.device)
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
