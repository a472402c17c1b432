"""Attention parallelism between processes over `torch.distributed` (gloo on CPU; NCCL-capable layout).

`DistKVSource` is the decode side's `remote_kv.KVSource` for a holder in another process (another rank of
one process group): each call — one per layer per step per holder, with all of that step's rows for it —
sends a header, the queries, the leased block tables and lengths, and receives a status, the partial output
and its log-sum-exp (zeros with a failure status). The sends and receives are posted at once and waited
for when the result is asked, so the decode side attends over its own KV meanwhile. `KVServer` runs on
the holder's process: a thread that answers those calls from its engine's cache through the same code an
in-process caller uses (`LocalKVSource`). Leases are taken on the holder as usual (`LLMEngine.lease_kv`);
their block ids reach the decode side however the caller's control channel carries them (the manager's
HTTP API, a queue in tests).

Point-to-point messages between two ranks arrive in order, so one header is followed by its tensors from
the same sender; the server answers each sender in turn.
"""

from __future__ import annotations

import logging
import threading

import torch
import torch.distributed as dist

from server.engine.remote_kv import KVSourceLostError, LocalKVSource

log = logging.getLogger(__name__)

# Header: [layer, rows, heads, head_dim, table width, query dtype code, the scale's float64 bits].
_HEADER = 7
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class DistKVSource:
    """The `KVSource` of a holder at rank ``peer`` of the default process group."""

    def __init__(self, peer: int, name: str | None = None) -> None:
        self.peer = peer
        self.name = name or f"rank {peer}"

    def start_attention(
        self, layer: int, q: torch.Tensor, block_tables: torch.Tensor, lens: torch.Tensor, scale: float
    ) -> _Exchange:
        rows, heads, head_dim = q.shape
        scale_bits = int(torch.tensor([scale], dtype=torch.float64).view(torch.int64))
        header = torch.tensor(
            [layer, rows, heads, head_dim, block_tables.shape[1], _DTYPES.index(q.dtype), scale_bits],
            dtype=torch.int64,
        )
        sent = [
            header,
            q.detach().cpu().contiguous(),
            block_tables.cpu().to(torch.int32).contiguous(),
            lens.cpu().to(torch.int32).contiguous(),
        ]
        answer = (
            torch.empty(1, dtype=torch.int64),
            torch.empty(rows, heads, head_dim, dtype=torch.float32),
            torch.empty(rows, heads, dtype=torch.float32),
        )
        try:  # nonblocking: the caller attends over its own KV while the holder attends over this
            works = [dist.isend(t, self.peer) for t in sent] + [dist.irecv(t, self.peer) for t in answer]
        except RuntimeError as e:  # gloo: the peer closed the connection
            raise KVSourceLostError(f"the KV holder at {self.name} cannot be reached: {e}") from e
        return _Exchange(self.name, sent, answer, works, q.device)


class _Exchange:
    """One layer's exchange with a `DistKVSource`'s holder, under way."""

    def __init__(
        self,
        name: str,
        sent: list[torch.Tensor],
        answer: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        works: list[dist.Work | None],
        device: torch.device,
    ) -> None:
        self.name, self.sent, self.answer, self.works, self.device = name, sent, answer, works, device

    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        try:
            for work in self.works:
                if work is not None:  # None only from a backend that completes at once
                    work.wait()
        except RuntimeError as e:  # gloo: the peer closed the connection or timed out
            raise KVSourceLostError(f"the KV holder at {self.name} cannot be reached: {e}") from e
        status, out, lse = self.answer
        if status.item() != 0:
            raise KVSourceLostError(f"the KV holder at {self.name} failed to attend (see its log)")
        return out.to(self.device), lse.to(self.device)


class KVServer:
    """Answers `DistKVSource` calls from other ranks with ``source`` (this process's engine's
    `LLMEngine.kv_source`), on a daemon thread, until the process group goes away."""

    def __init__(self, source: LocalKVSource) -> None:
        self.source = source
        self.calls = 0
        self._thread = threading.Thread(target=self._serve, name="kv-server", daemon=True)

    def start(self) -> KVServer:
        self._thread.start()
        return self

    def _serve(self) -> None:
        header = torch.empty(_HEADER, dtype=torch.int64)
        while True:
            try:
                peer = dist.recv(header)  # from any rank
                self._answer(peer, header.tolist())
            except RuntimeError as e:  # the group was destroyed or a peer died: nothing left to serve
                log.info("KV server stops: %s", e)
                return

    def _answer(self, peer: int, header: list[int]) -> None:
        layer, rows, heads, head_dim, width, dtype_code, scale_bits = header
        scale = float(torch.tensor([scale_bits], dtype=torch.int64).view(torch.float64))
        q = torch.empty(rows, heads, head_dim, dtype=_DTYPES[dtype_code])
        tables = torch.empty(rows, width, dtype=torch.int32)
        lens = torch.empty(rows, dtype=torch.int32)
        for t in (q, tables, lens):
            dist.recv(t, peer)
        try:
            out, lse = self.source.partial_attention(layer, q, tables, lens, scale)
            status = torch.zeros(1, dtype=torch.int64)
        except Exception:  # answer a failure, so the caller is not left waiting: it fails those rows
            log.exception("partial attention failed for rank %d", peer)
            status = torch.ones(1, dtype=torch.int64)
            out, lse = torch.zeros(rows, heads, head_dim), torch.zeros(rows, heads)  # (the caller's receives)
        dist.send(status, peer)
        dist.send(out.float().cpu().contiguous(), peer)
        dist.send(lse.float().cpu().contiguous(), peer)
        self.calls += int(status.item() == 0)
