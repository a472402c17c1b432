"""Attention over KV that lives on another engine: Mutel's attention parallelism.

A prefill instance keeps a conversation's prompt KV; a decode instance runs the decode. At every layer of
every step the decode instance sends the queries of its rows whose context starts with remote KV to the
engine holding that KV, which attends them over it and answers a partial output with its log-sum-exp; the
decode instance merges that, exactly (`kernels.merge_attention_states`), with its own partial over the
tokens it holds. One exchange per layer per source for the whole step.

* The holder pins what it serves with a `KVLease`: a reference on each block of the context's first
  ``num_tokens`` tokens. A block someone else holds is never written (copy-on-write) nor freed, so the
  holder may extend, evict or free the context meanwhile and the leased KV stays exactly as it was.
* A `KVSource` computes the partial attention where the KV lives: `LocalKVSource` for an engine in this
  process (the query moves to the holder's device and the result back), `server.engine.remote_kv_dist`
  over `torch.distributed` between processes. Both count the bytes a wire would carry.
* Every query row of a remote-prefixed context — a decode token, or each token of a recomputed fill — is a
  decode row over its local blocks (a token at local index i sees local keys 0..i), since all remote keys
  precede all local ones; so one paged partial covers the local side of every such row. It is computed
  after the queries went out (`KVSource.start_attention`), while the holders attend.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

import kernels
from kernels import torch_path
from kernels.device_tensors import device_tensor
from server.engine.attention import pad_tables
from server.engine.errors import EngineError

_lease_ids = itertools.count(1)


class KVSourceLostError(EngineError):
    """The engine holding a context's remote KV stopped or cannot be reached; the request on it fails,
    other requests of the step go on."""

    http_status = 503
    error_type = "kv_source_lost"


@dataclass(frozen=True)
class KVLease:
    """The first ``num_tokens`` tokens of context ``context_id`` pinned on the engine that holds them."""

    context_id: int
    blocks: tuple[int, ...]
    num_tokens: int
    lease_id: int = field(default_factory=lambda: next(_lease_ids))


class PendingAttention(Protocol):
    """A partial attention under way on the holder."""

    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out [N, H, D] float32, lse [N, H] float32)`` on the query's device, once the holder answered.
        Raises `KVSourceLostError` if the holder is gone."""
        ...


class KVSource(Protocol):
    """Attends queries over leased KV on the engine that holds it."""

    name: str

    def start_attention(
        self, layer: int, q: torch.Tensor, block_tables: torch.Tensor, lens: torch.Tensor, scale: float
    ) -> PendingAttention:
        """Send ``q [N, H, D]`` to attend over ``lens[i]`` tokens of ``block_tables[i]`` in layer ``layer``;
        the answer comes with the result's `PendingAttention.result`, so the caller attends over its own KV
        meanwhile. Raises `KVSourceLostError` if the holder is gone."""
        ...


@dataclass(frozen=True)
class RemotePrefix:
    """A context's leading tokens whose KV is on another engine: served by ``source`` from ``lease``."""

    source: KVSource
    lease: KVLease

    @property
    def num_tokens(self) -> int:
        return self.lease.num_tokens


def exchange_bytes(rows: int, num_heads: int, head_dim: int, q_dtype: torch.dtype, max_blocks: int) -> int:
    """What one layer's exchange with one source carries: queries, block tables and lengths out; a float32
    partial output and its LSE back."""
    out = rows * (num_heads * head_dim * q_dtype.itemsize + (max_blocks + 1) * 4)
    back = rows * num_heads * (head_dim + 1) * 4
    return out + back


class LocalKVSource:
    """The `KVSource` of an engine in this process: attends on the holder's cache, on its device."""

    def __init__(
        self, name: str, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor], alive: Callable[[], bool]
    ) -> None:
        self.name = name
        self._k = k_caches
        self._v = v_caches
        self._alive = alive

    def start_attention(
        self, layer: int, q: torch.Tensor, block_tables: torch.Tensor, lens: torch.Tensor, scale: float
    ) -> PendingAttention:
        """In this process the holder's kernels run on the caller's thread: the attention runs when its
        result is asked for (after the caller's own), as one call."""
        return _Deferred(lambda: self.partial_attention(layer, q, block_tables, lens, scale))

    def partial_attention(
        self, layer: int, q: torch.Tensor, block_tables: torch.Tensor, lens: torch.Tensor, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``q`` over the leased KV now: ``(out, lse)`` float32 on ``q``'s device (`PendingAttention`)."""
        if not self._alive():
            raise KVSourceLostError(f"engine {self.name!r}, which holds this context's prompt KV, stopped")
        k, v = self._k[layer], self._v[layer]
        dev = k.device
        out, lse = torch_path.paged_decode_partial(q.to(dev), k, v, block_tables.to(dev), lens.to(dev), scale)
        return out.to(q.device), lse.to(q.device)


@dataclass(frozen=True)
class _Deferred:
    """A `PendingAttention` computed when its result is asked for."""

    compute: Callable[[], tuple[torch.Tensor, torch.Tensor]]

    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.compute()


@dataclass
class SourceRows:
    """The rows of a step served by one source (indices into `RemoteRows.rows`) and their leased tables."""

    source: KVSource
    index: torch.Tensor  # [M] int64
    block_tables: torch.Tensor  # [M, max_blocks] int32 (the lease's blocks, on the holder)
    lens: torch.Tensor  # [M] int32
    context_ids: list[int]  # the decode engine's contexts these rows belong to (to fail them if it is lost)


@dataclass
class RemoteRows:
    """A step's query rows whose context starts with remote KV, with what each attends locally."""

    rows: torch.Tensor  # [N] int64 rows of the step
    local_tables: torch.Tensor  # [N, max_blocks] int32, the context's own blocks
    local_lens: torch.Tensor  # [N] int32, local keys the row sees (its own included)
    by_source: list[SourceRows]
    bytes_moved: int = 0
    # Sources that failed during this step, by id(): their rows' results are garbage, their requests fail.
    failures: dict[int, tuple[SourceRows, BaseException]] = field(default_factory=dict)

    def attend(
        self,
        layer: int,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        scale: float,
        out: torch.Tensor,
    ) -> None:
        """Write these rows' attention (local partial merged with each source's) into ``out``. The queries
        go out to every source first; the local partial is computed while they attend."""
        qr = q.index_select(0, self.rows)
        pending: list[tuple[SourceRows, PendingAttention]] = []
        for part in self.by_source:
            if id(part.source) in self.failures:
                continue  # lost in an earlier layer: skip the exchange, the rows are failed after the step
            try:
                sent = part.source.start_attention(
                    layer, qr.index_select(0, part.index), part.block_tables, part.lens, scale
                )
            except Exception as e:  # any transport failure loses only this source's rows
                self.failures[id(part.source)] = (part, e)
                continue
            pending.append((part, sent))
        acc, acc_lse = torch_path.paged_decode_partial(
            qr, k_cache, v_cache, self.local_tables, self.local_lens, scale
        )
        for part, sent in pending:
            try:
                r_out, r_lse = sent.result()
            except Exception as e:
                self.failures[id(part.source)] = (part, e)
                continue
            self.bytes_moved += exchange_bytes(
                int(part.index.numel()),
                q.shape[1],
                q.shape[2],
                q.dtype,
                int(part.block_tables.shape[1]),
            )
            merged, lse = kernels.merge_attention_states(
                acc.index_select(0, part.index), acc_lse.index_select(0, part.index), r_out, r_lse
            )
            acc.index_copy_(0, part.index, merged)
            acc_lse.index_copy_(0, part.index, lse)
        out.index_copy_(0, self.rows, acc.to(out.dtype))

    def lost(self) -> dict[int, BaseException]:
        """Context id -> the error of each context whose source failed during the step."""
        return {cid: err for part, err in self.failures.values() for cid in part.context_ids}


def build_remote_rows(
    rows: list[tuple[int, int, list[int], RemotePrefix, int]], device: torch.device
) -> RemoteRows:
    """``rows``: (step row, local keys seen, local block table, remote prefix, context id) per query row."""
    by_source: dict[int, list[int]] = {}
    for i, (_, _, _, remote, _) in enumerate(rows):
        by_source.setdefault(id(remote.source), []).append(i)
    parts = []
    for members in by_source.values():
        first = rows[members[0]][3]
        parts.append(
            SourceRows(
                source=first.source,
                index=device_tensor(members, torch.int64, device),
                block_tables=pad_tables([list(rows[i][3].lease.blocks) for i in members], device),
                lens=device_tensor([rows[i][3].num_tokens for i in members], torch.int32, device),
                context_ids=sorted({rows[i][4] for i in members}),
            )
        )
    return RemoteRows(
        rows=device_tensor([r[0] for r in rows], torch.int64, device),
        local_tables=pad_tables([r[2] for r in rows], device),
        local_lens=device_tensor([r[1] for r in rows], torch.int32, device),
        by_source=parts,
    )
