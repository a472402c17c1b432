"""Triton kernels: paged decode, shared-prefix decode (prefix pass + suffix pass) and the LSE merge.

Plain pointer arithmetic only (no block pointers: triton 3.9 removed them), so the same source runs on
triton 3.6-3.9 and in the CPU interpreter (``TRITON_INTERPRET=1``).

Layout of the work:

* Every attention program owns one KV head and a tile of query rows. In paged decode the rows are the query
  heads of that KV head for one sequence (GQA), padded to 16 for ``tl.dot``. In the prefix pass they are
  (member sequence, query head) pairs of one group, so one tile loop over the prefix KV serves all of the
  group's queries: the prefix is read once per tile instead of once per sequence.
* Long key ranges are split across programs (split-KV), each writing a normalised partial output and its
  log-sum-exp into a slot of a float32 partial buffer; one reduce kernel merges the slots (the prefix
  splits and the suffix splits of a sequence alike) exactly, ignoring empty ones.
* Softmax runs in base 2 (``exp2``) with the scale folded in; partial LSEs are stored in natural log.

Nothing here synchronises with the host: grid sizes come from tensor shapes (table widths bound the
lengths), and the grouping metadata is built with device-side torch ops.
"""

from __future__ import annotations

import functools
import threading
import weakref

import torch
import triton
import triton.language as tl

__all__ = [
    "merge_attention_states",
    "paged_decode_attention",
    "shared_prefix_decode_attention",
]

LOG2E = 1.4426950408889634  # host side: the softmax scale is folded into base 2
# Kernels may only read globals that are constexpr.
_LN2: tl.constexpr = tl.constexpr(0.6931471805599453)

# Split-KV policy: aim for this many programs per streaming multiprocessor, but never give a split fewer
# than MIN_SPLIT_TOKENS keys (a split's fixed cost must stay small against its loop). Tuned on the H100
# (`benchmarks.kernel_tuning`, device time): 2 beat 4 and 8 for plain and shared-prefix decode at every
# headline shape (plain b64 p4k 0.217 vs 0.224 ms, shared 0.079 vs 0.090 ms); the other settings' shipped
# values were the sweep's best.
PROGRAMS_PER_SM = 2
MIN_SPLIT_TOKENS = 256
MAX_SPLITS = 64
BLOCK_N = 64  # keys per loop iteration
PREFIX_BLOCK_M = 64  # (member, head) rows per prefix-pass tile


@triton.jit
def _attend_tile(
    q,
    acc,
    m_i,
    l_i,
    k_ptr,
    v_ptr,
    table_ptr,
    kv_head,
    start,
    end,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    qk_scale,
    PAGE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PREC: tl.constexpr,
    visible=None,
    CAUSAL: tl.constexpr = False,
):
    """Online-softmax loop of a ``[BLOCK_M, BLOCK_D]`` query tile over keys ``[start, end)`` of one table;
    ``CAUSAL``: row ``r`` sees only the keys before ``visible[r]`` (a prefill tile's last keys)."""
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    for n0 in range(start, end, BLOCK_N):
        offs_t = n0 + tl.arange(0, BLOCK_N)
        t_mask = offs_t < end
        block = tl.load(table_ptr + offs_t // PAGE, mask=t_mask, other=0).to(tl.int64)
        slot = offs_t % PAGE
        k_off = block * stride_kb + slot * stride_kt + kv_head * stride_kh
        v_off = block * stride_vb + slot * stride_vt + kv_head * stride_vh
        kv_mask = t_mask[None, :] & d_mask[:, None]
        k_t = tl.load(k_ptr + k_off[None, :] + offs_d[:, None], mask=kv_mask, other=0.0)  # [D, N]
        s = tl.dot(q, k_t, input_precision=DOT_PREC) * qk_scale
        s = tl.where(t_mask[None, :], s, float("-inf"))
        if CAUSAL:
            s = tl.where(offs_t[None, :] < visible[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_ptr + v_off[:, None] + offs_d[None, :], mask=t_mask[:, None] & d_mask[None, :], other=0.0
        )  # [N, D]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _paged_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    tables_ptr,
    lens_ptr,
    out_ptr,
    part_o_ptr,
    part_lse_ptr,
    stride_qb,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_tb,
    stride_ob,
    stride_oh,
    stride_pb,
    stride_ph,
    stride_ps,
    slot_base,
    split_tokens,
    qk_scale,
    GROUP: tl.constexpr,
    PAGE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    WRITE_FINAL: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """Program (sequence, KV head, split): the GROUP query heads of that KV head over one key range."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    ctx_len = tl.load(lens_ptr + seq)
    start = split * split_tokens
    end = tl.minimum(start + split_tokens, ctx_len)

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_mask = offs_m < GROUP
    d_mask = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_m
    io_mask = m_mask[:, None] & d_mask[None, :]
    q = tl.load(
        q_ptr + seq * stride_qb + heads[:, None] * stride_qh + offs_d[None, :], mask=io_mask, other=0.0
    )

    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)  # finite: no inf - inf when a tile is all masked
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc, m_i, l_i = _attend_tile(
        q, acc, m_i, l_i, k_ptr, v_ptr, tables_ptr + seq * stride_tb, kv_head, start, end,
        stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, qk_scale,
        PAGE, HEAD_DIM, BLOCK_N, BLOCK_D, DOT_PREC,
    )  # fmt: skip

    nonempty = l_i > 0.0
    out = acc / tl.where(nonempty, l_i, 1.0)[:, None]
    if WRITE_FINAL:
        o_ptrs = out_ptr + seq * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=io_mask)
    else:
        lse = tl.where(nonempty, (m_i + tl.log2(tl.where(nonempty, l_i, 1.0))) * _LN2, float("-inf"))
        base = seq * stride_pb + heads * stride_ph + (slot_base + split) * stride_ps
        tl.store(part_o_ptr + base[:, None] * HEAD_DIM + offs_d[None, :], out, mask=io_mask)
        tl.store(part_lse_ptr + base, lse, mask=m_mask)


@triton.jit
def _prefix_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    prefix_tables_ptr,
    prefix_lens_ptr,
    members_ptr,
    member_start_ptr,
    member_count_ptr,
    tile_group_ptr,
    tile_row_ptr,
    part_o_ptr,
    part_lse_ptr,
    stride_qb,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_tg,
    stride_pb,
    stride_ph,
    stride_ps,
    split_tokens,
    qk_scale,
    GROUP: tl.constexpr,
    PAGE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """Program (tile, KV head, split): BLOCK_M (member, query head) rows of one group over a prefix range.

    Rows are member-major: row r is query head ``r % GROUP`` of the group's member ``r // GROUP``. Padding
    tiles (group -1) and padding rows load nothing and store nothing.
    """
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    group = tl.load(tile_group_ptr + tile)
    live = group >= 0
    g = tl.maximum(group, 0)
    row0 = tl.load(tile_row_ptr + tile)
    count = tl.where(live, tl.load(member_count_ptr + g), 0)
    first = tl.load(member_start_ptr + g)
    prefix_len = tl.where(live, tl.load(prefix_lens_ptr + g), 0)
    start = split * split_tokens
    end = tl.minimum(start + split_tokens, prefix_len)

    rows = row0 + tl.arange(0, BLOCK_M)
    member = rows // GROUP
    m_mask = member < count
    seqs = tl.load(members_ptr + first + member, mask=m_mask, other=0)
    heads = kv_head * GROUP + rows % GROUP
    offs_d = tl.arange(0, BLOCK_D)
    io_mask = m_mask[:, None] & (offs_d < HEAD_DIM)[None, :]
    q = tl.load(
        q_ptr + seqs[:, None] * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=io_mask,
        other=0.0,
    )

    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc, m_i, l_i = _attend_tile(
        q, acc, m_i, l_i, k_ptr, v_ptr, prefix_tables_ptr + g * stride_tg, kv_head, start, end,
        stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, qk_scale,
        PAGE, HEAD_DIM, BLOCK_N, BLOCK_D, DOT_PREC,
    )  # fmt: skip

    nonempty = l_i > 0.0
    out = acc / tl.where(nonempty, l_i, 1.0)[:, None]
    lse = tl.where(nonempty, (m_i + tl.log2(tl.where(nonempty, l_i, 1.0))) * _LN2, float("-inf"))
    base = seqs * stride_pb + heads * stride_ph + split * stride_ps
    tl.store(part_o_ptr + base[:, None] * HEAD_DIM + offs_d[None, :], out, mask=io_mask)
    tl.store(part_lse_ptr + base, lse, mask=m_mask)


@triton.jit
def _reduce_kernel(
    part_o_ptr,
    part_lse_ptr,
    group_of_ptr,
    out_ptr,
    stride_pb,
    stride_ph,
    stride_ob,
    stride_oh,
    num_slots,
    prefix_slots,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_GROUPS: tl.constexpr,
):
    """Program (sequence, head): exact LSE merge of the partial slots into the final output.

    Slots ``[0, prefix_slots)`` hold prefix splits and count only when the sequence is in a group (an
    ungrouped sequence's prefix slots are never written); the rest are suffix/context splits. Empty slots
    (``lse = -inf``) get weight 0 and their outputs are not read.
    """
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    first_slot = 0
    if HAS_GROUPS:
        first_slot = tl.where(tl.load(group_of_ptr + seq) >= 0, 0, prefix_slots)
    s_mask = (offs_s >= first_slot) & (offs_s < num_slots)
    base = seq * stride_pb + head * stride_ph
    lse = tl.load(part_lse_ptr + base + offs_s, mask=s_mask, other=float("-inf"))
    lse = tl.where(s_mask, lse, float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.where(lse == float("-inf"), 0.0, tl.exp(lse - m))
    total = tl.sum(w, 0)
    used = w > 0.0
    o_ptrs = part_o_ptr + (base + offs_s)[:, None] * HEAD_DIM + offs_d[None, :]
    parts = tl.load(o_ptrs, mask=used[:, None] & (offs_d < HEAD_DIM)[None, :], other=0.0)
    out = tl.sum(parts * w[:, None], 0) / tl.where(total > 0.0, total, 1.0)
    tl.store(
        out_ptr + seq * stride_ob + head * stride_oh + offs_d,
        out.to(out_ptr.dtype.element_ty),
        mask=offs_d < HEAD_DIM,
    )


@triton.jit
def _merge_kernel(
    out_a_ptr,
    lse_a_ptr,
    out_b_ptr,
    lse_b_ptr,
    out_ptr,
    lse_ptr,
    rows,
    HEAD_DIM: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Rows ``[pid * BLOCK_R, ...)`` of the two-way LSE merge, float32 math, empty partials ignored."""
    offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_d = tl.arange(0, BLOCK_D)
    r_mask = offs_r < rows
    la = tl.load(lse_a_ptr + offs_r, mask=r_mask, other=float("-inf")).to(tl.float32)
    lb = tl.load(lse_b_ptr + offs_r, mask=r_mask, other=float("-inf")).to(tl.float32)
    m = tl.maximum(la, lb)
    m = tl.where(m == float("-inf"), 0.0, m)
    wa = tl.where(la == float("-inf"), 0.0, tl.exp(la - m))
    wb = tl.where(lb == float("-inf"), 0.0, tl.exp(lb - m))
    total = wa + wb
    safe = tl.where(total > 0.0, total, 1.0)
    io = offs_r[:, None] * HEAD_DIM + offs_d[None, :]
    d_mask = (offs_d < HEAD_DIM)[None, :]
    oa = tl.load(out_a_ptr + io, mask=r_mask[:, None] & d_mask & (wa > 0.0)[:, None], other=0.0).to(
        tl.float32
    )
    ob = tl.load(out_b_ptr + io, mask=r_mask[:, None] & d_mask & (wb > 0.0)[:, None], other=0.0).to(
        tl.float32
    )
    out = (oa * (wa / safe)[:, None]) + (ob * (wb / safe)[:, None])
    tl.store(out_ptr + io, out.to(out_ptr.dtype.element_ty), mask=r_mask[:, None] & d_mask)
    lse = tl.where(total > 0.0, m + tl.log(safe), float("-inf"))
    tl.store(lse_ptr + offs_r, lse, mask=r_mask)


# ----------------------------------------------------------------------------------------------- host side


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 8  # the interpreter: any small number, it only shapes the split choice


def _splits(max_tokens: int, programs: int, device: torch.device) -> tuple[int, int]:
    """(number of splits, keys per split) for key ranges up to ``max_tokens`` over ``programs`` programs."""
    target = PROGRAMS_PER_SM * _sm_count(device)
    want = -(-target // max(programs, 1))
    cap = max(1, max_tokens // MIN_SPLIT_TOKENS)
    n = max(1, min(want, cap, MAX_SPLITS))
    per = -(-max(max_tokens, 1) // n)
    per = -(-per // BLOCK_N) * BLOCK_N  # whole loop iterations per split
    return -(-max(max_tokens, 1) // per), per


def _check(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int, int, int]:
    batch, num_heads, head_dim = q.shape
    _, page, num_kv_heads, kd = k_cache.shape
    if kd != head_dim or v_cache.shape != k_cache.shape or num_heads % num_kv_heads:
        raise ValueError(
            f"shape mismatch: q {tuple(q.shape)}, k {tuple(k_cache.shape)}, v {tuple(v_cache.shape)}"
        )
    if k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("the KV cache's head_dim must be contiguous")
    return batch, num_heads, head_dim, page, num_heads // num_kv_heads


def _launch_paged(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
    *,
    out: torch.Tensor | None,
    part_o: torch.Tensor | None,
    part_lse: torch.Tensor | None,
    slot_base: int,
    splits: int,
    split_tokens: int,
) -> None:
    batch, num_heads, head_dim, page, group = _check(q, k_cache, v_cache)
    num_kv_heads = num_heads // group
    write_final = out is not None
    dummy = q  # unused pointer arguments still need a tensor
    if out is not None:
        o, po, pl = out, dummy, dummy
    else:  # the split partials, merged by the caller
        assert part_o is not None and part_lse is not None, "give out, or part_o and part_lse"
        o, po, pl = dummy, part_o, part_lse
    _paged_kernel[(batch, num_kv_heads, splits)](
        q, k_cache, v_cache, tables, lens, o, po, pl,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        tables.stride(0),
        o.stride(0) if write_final else 0, o.stride(1) if write_final else 0,
        po.stride(0) // head_dim if not write_final else 0,
        po.stride(1) // head_dim if not write_final else 0,
        po.stride(2) // head_dim if not write_final else 0,
        slot_base, split_tokens, scale * LOG2E,
        GROUP=group, PAGE=page, HEAD_DIM=head_dim,
        BLOCK_M=max(16, triton.next_power_of_2(group)), BLOCK_N=BLOCK_N,
        BLOCK_D=_dot_width(head_dim), WRITE_FINAL=write_final,
        DOT_PREC=_dot_precision(q), num_warps=4,
    )  # fmt: skip


def _dot_width(head_dim: int) -> int:
    """The head-dim tile of the kernels that use ``tl.dot``: a power of two, at least 16 (the smallest
    product shape the GPU's matrix units take; the extra columns are masked)."""
    return max(16, triton.next_power_of_2(head_dim))


def _dot_precision(q: torch.Tensor) -> str:
    # fp32 must stay fp32: the default would round the operands to TF32 on tensor cores.
    return "ieee" if q.dtype == torch.float32 else "tf32"


def _reduce(
    part_o: torch.Tensor,
    part_lse: torch.Tensor,
    out: torch.Tensor,
    group_of: torch.Tensor | None,
    prefix_slots: int,
) -> None:
    batch, num_heads, num_slots, head_dim = part_o.shape
    _reduce_kernel[(batch, num_heads)](
        part_o, part_lse, group_of if group_of is not None else part_lse, out,
        part_lse.stride(0), part_lse.stride(1), out.stride(0), out.stride(1),
        num_slots, prefix_slots,
        HEAD_DIM=head_dim, BLOCK_S=max(2, triton.next_power_of_2(num_slots)),
        BLOCK_D=triton.next_power_of_2(head_dim), HAS_GROUPS=group_of is not None, num_warps=4,
    )  # fmt: skip


def _contig_q(q: torch.Tensor) -> torch.Tensor:
    return q if q.stride(2) == 1 else q.contiguous()


def _i32(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype == torch.int32 and x.is_contiguous() else x.to(torch.int32).contiguous()


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Paged decode attention (Triton); see :func:`kernels.paged_decode_attention`."""
    q = _contig_q(q)
    batch, num_heads, head_dim, page, group = _check(q, k_cache, v_cache)
    tables, lens = _i32(block_tables), _i32(context_lens)
    out = torch.empty_like(q)
    if batch == 0:
        return out
    max_tokens = tables.shape[1] * page
    splits, per = _splits(max_tokens, batch * (num_heads // group), q.device)
    if splits == 1:
        _launch_paged(q, k_cache, v_cache, tables, lens, scale, out=out, part_o=None, part_lse=None,
                      slot_base=0, splits=1, split_tokens=per)  # fmt: skip
        return out
    part_o = torch.empty(batch, num_heads, splits, head_dim, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(batch, num_heads, splits, dtype=torch.float32, device=q.device)
    _launch_paged(q, k_cache, v_cache, tables, lens, scale, out=None, part_o=part_o, part_lse=part_lse,
                  slot_base=0, splits=splits, split_tokens=per)  # fmt: skip
    _reduce(part_o, part_lse, out, None, 0)
    return out


def _group_tiles(
    group_of: torch.Tensor, num_groups: int, group: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Device-side tiling of the grouped sequences, without a host sync.

    Returns ``members`` (sequence ids sorted by group), ``member_start``/``member_count`` per group,
    ``tile_group``/``tile_row`` per tile (group -1 for padding tiles) and the tile count bound.
    """
    batch = group_of.shape[0]
    device = group_of.device
    key = torch.where(group_of >= 0, group_of, num_groups).long()
    members = torch.argsort(key, stable=True).to(torch.int32)
    counts = torch.zeros(num_groups + 1, dtype=torch.long, device=device)
    counts.scatter_add_(0, key, torch.ones_like(key))
    counts = counts[:num_groups]
    start = torch.cumsum(counts, 0) - counts
    tiles = (counts * group + block_m - 1) // block_m
    tile_end = torch.cumsum(tiles, 0)
    # Each group wastes at most one partial tile, so this bounds the tile count without reading it back.
    max_tiles = -(-batch * group // block_m) + num_groups
    pid = torch.arange(max_tiles, device=device)
    tile_group = torch.searchsorted(tile_end, pid, right=True)
    live = tile_group < num_groups
    g = tile_group.clamp(max=num_groups - 1)
    tile_row = (pid - (tile_end[g] - tiles[g])) * block_m
    tile_group = torch.where(live, tile_group, -1).to(torch.int32)
    return (
        members,
        start.to(torch.int32),
        counts.to(torch.int32),
        tile_group,
        tile_row.to(torch.int32),
        max_tiles,
    )


class _TileCache(threading.local):
    """The last grouping metadata, per thread.

    The engine passes the same ``group_of`` tensor to every layer of a decode step, so the metadata (about
    ten small device ops) is built once per step instead of once per layer. The entry is keyed on the
    tensor object itself (a weak reference, so a new tensor at a recycled address never hits) and its
    version counter (an in-place update invalidates it).
    """

    def __init__(self) -> None:
        self.ref: weakref.ref[torch.Tensor] | None = None
        self.key: tuple = ()
        self.value: tuple | None = None


_tile_cache = _TileCache()


def _cached_group_tiles(
    source: torch.Tensor, group_of: torch.Tensor, num_groups: int, group: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]:
    key = (source._version, num_groups, group, block_m)
    cache = _tile_cache
    if cache.value is not None and cache.ref is not None and cache.ref() is source and cache.key == key:
        return cache.value
    value = _group_tiles(group_of, num_groups, group, block_m)
    cache.ref, cache.key, cache.value = weakref.ref(source), key, value
    return value


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
    """Shared-prefix decode attention (Triton); see :func:`kernels.shared_prefix_decode_attention`."""
    q = _contig_q(q)
    batch, num_heads, head_dim, page, group = _check(q, k_cache, v_cache)
    num_kv_heads = num_heads // group
    out = torch.empty_like(q)
    num_groups = prefix_block_tables.shape[0]
    if batch == 0:
        return out
    if num_groups == 0:
        return paged_decode_attention(q, k_cache, v_cache, suffix_block_tables, suffix_lens, scale)
    prefix_tables, plens = _i32(prefix_block_tables), _i32(prefix_lens)
    suffix_tables, slens, groups = _i32(suffix_block_tables), _i32(suffix_lens), _i32(group_of)

    members, mstart, mcount, tile_group, tile_row, max_tiles = _cached_group_tiles(
        group_of, groups, num_groups, group, PREFIX_BLOCK_M
    )
    tiles_est = max(1, -(-batch * group // PREFIX_BLOCK_M))
    p_splits, p_per = _splits(prefix_tables.shape[1] * page, tiles_est * num_kv_heads, q.device)
    s_splits, s_per = _splits(suffix_tables.shape[1] * page, batch * num_kv_heads, q.device)
    # Slots [0, p_splits) take the prefix splits, the rest the suffix splits; nothing needs initialising
    # (the reduce skips an ungrouped sequence's prefix slots, and every other slot is written).
    num_slots = p_splits + s_splits
    part_o = torch.empty(batch, num_heads, num_slots, head_dim, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(batch, num_heads, num_slots, dtype=torch.float32, device=q.device)

    _prefix_kernel[(max_tiles, num_kv_heads, p_splits)](
        q, k_cache, v_cache, prefix_tables, plens, members, mstart, mcount, tile_group, tile_row,
        part_o, part_lse,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        prefix_tables.stride(0),
        part_lse.stride(0), part_lse.stride(1), part_lse.stride(2),
        p_per, scale * LOG2E,
        GROUP=group, PAGE=page, HEAD_DIM=head_dim, BLOCK_M=PREFIX_BLOCK_M, BLOCK_N=BLOCK_N,
        BLOCK_D=_dot_width(head_dim), DOT_PREC=_dot_precision(q), num_warps=4,
    )  # fmt: skip
    _launch_paged(q, k_cache, v_cache, suffix_tables, slens, scale, out=None, part_o=part_o,
                  part_lse=part_lse, slot_base=p_splits, splits=s_splits, split_tokens=s_per)  # fmt: skip
    _reduce(part_o, part_lse, out, groups, p_splits)
    return out


def merge_attention_states(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact LSE merge (Triton); see :func:`kernels.merge_attention_states`."""
    head_dim = out_a.shape[-1]
    oa = out_a.reshape(-1, head_dim).contiguous()
    ob = out_b.reshape(-1, head_dim).contiguous()
    la = lse_a.reshape(-1).contiguous()
    lb = lse_b.reshape(-1).contiguous()
    rows = oa.shape[0]
    out = torch.empty_like(oa)
    lse = torch.empty(rows, dtype=torch.float32, device=oa.device)
    block_r = 16
    if rows:
        _merge_kernel[(triton.cdiv(rows, block_r),)](
            oa, la, ob, lb, out, lse, rows,
            HEAD_DIM=head_dim, BLOCK_R=block_r, BLOCK_D=triton.next_power_of_2(head_dim), num_warps=4,
        )  # fmt: skip
    return out.view(out_a.shape), lse.view(lse_a.shape)
