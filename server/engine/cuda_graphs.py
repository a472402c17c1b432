"""Decode steps replayed as CUDA graphs, one per batch-size bucket (as vLLM and nano-vllm do).

An eager decode step of a large model on a GPU is bound by the host: each layer launches a dozen kernels
from Python, which at batch 1 costs several times the step's memory-bound device time. A graph records a
whole step's launches once and replays them with one call. Graphs need fixed shapes and addresses, so:

* a graph is captured per bucket of batch sizes (`graph_batch_sizes`); a step of B sequences replays the
  smallest bucket >= B (`bucket_for`), its rows past B being padding;
* inputs live in static buffers the step copies into: token ids, positions, KV slots, block tables (as wide
  as the longest context allows) and context lengths;
* padding rows write their K/V into a scratch block that no context owns and attend over it (one token), so
  they touch nothing real.

Only pure decode steps without shared-prefix grouping or remote KV replay; every other step runs eagerly
(`ModelRunner.run`). Capturing is done by a `GraphBackend`: CUDA's on a GPU; tests on CPU inject one that
re-runs the recorded step, which checks the buffers and padding without a GPU.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from server.engine.attention import AttentionMetadata, DecodeBatch
from server.engine.config import EngineConfig

__all__ = [
    "CudaGraphBackend",
    "DecodeGraphs",
    "GraphBackend",
    "bucket_for",
    "graph_backend",
    "graph_batch_sizes",
    "try_capture",
]

log = logging.getLogger(__name__)

# Forward over (token ids, positions, metadata) -> final hidden states of every row.
StepForward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]


def graph_batch_sizes(max_batch: int) -> list[int]:
    """The buckets captured for batches of up to ``max_batch`` sequences: 1, 2, 4, 8, then every 16, and
    ``max_batch`` itself (padding at most 15 rows, 7% at batch 200)."""
    if max_batch < 1:
        return []
    sizes = {s for s in (1, 2, 4, 8) if s <= max_batch} | set(range(16, max_batch + 1, 16)) | {max_batch}
    return sorted(sizes)


def bucket_for(batch: int, sizes: Sequence[int]) -> int | None:
    """The smallest bucket holding ``batch`` rows (None: larger than every bucket)."""
    return next((s for s in sizes if s >= batch), None)


class GraphBackend(Protocol):
    """Records a step once and replays it."""

    def capture(self, step: Callable[[], None]) -> Any:
        """Record ``step`` (run once while recording); return what `replay` takes."""
        ...

    def replay(self, graph: Any) -> None: ...


class CudaGraphBackend:
    """`torch.cuda.CUDAGraph`s sharing one memory pool (buckets are captured largest first, so the smaller
    ones fit in what the largest allocated)."""

    def __init__(self) -> None:
        self._pool: Any = None

    def capture(self, step: Callable[[], None]) -> torch.cuda.CUDAGraph:
        graph = torch.cuda.CUDAGraph()
        # thread_local: other engines' threads may use the GPU while this one records.
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            step()
        if self._pool is None:
            self._pool = graph.pool()
        return graph

    def replay(self, graph: torch.cuda.CUDAGraph) -> None:
        graph.replay()


def graph_backend(config: EngineConfig) -> GraphBackend | None:
    """CUDA's graphs for an engine on a GPU with ``cuda_graphs`` on; None: eager steps."""
    return CudaGraphBackend() if config.cuda_graphs and config.torch_device().type == "cuda" else None


class DecodeGraphs:
    """Static inputs and one captured graph per bucket; `run` replays a decode step of up to `max_batch`."""

    def __init__(
        self,
        forward: StepForward,
        *,
        max_batch: int,
        max_blocks: int,
        block_size: int,
        scratch_block: int,
        hidden_size: int,
        dtype: torch.dtype,
        device: torch.device,
        backend: GraphBackend,
    ) -> None:
        self.sizes = graph_batch_sizes(max_batch)
        self.max_batch = max_batch
        self._forward = forward
        self._backend = backend
        self._scratch_block = scratch_block
        self._scratch_slot = scratch_block * block_size
        i64 = {"dtype": torch.int64, "device": device}
        i32 = {"dtype": torch.int32, "device": device}
        self.ids = torch.zeros(max_batch, **i64)
        self.positions = torch.zeros(max_batch, **i64)
        self.slots = torch.full((max_batch,), self._scratch_slot, **i64)
        self.tables = torch.full((max_batch, max(1, max_blocks)), scratch_block, **i32)
        self.lens = torch.ones(max_batch, **i32)
        self.hidden = torch.zeros(max_batch, hidden_size, dtype=dtype, device=device)
        self._graphs: dict[int, Any] = {}
        self.replays = 0  # steps served by a graph

    def capture(self) -> None:
        """Run each bucket once eagerly (kernels compile outside the recording), then record it."""
        for size in reversed(self.sizes):
            self._step(size)
            self._graphs[size] = self._backend.capture(lambda size=size: self._step(size))

    def _step(self, size: int) -> None:
        """What a graph holds: the forward over the static buffers' first ``size`` rows."""
        meta = AttentionMetadata(
            slot_mapping=self.slots[:size],
            decode=DecodeBatch(block_tables=self.tables[:size], context_lens=self.lens[:size]),
            prefills=[],
        )
        self.hidden[:size].copy_(self._forward(self.ids[:size], self.positions[:size], meta))

    def run(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        tables: torch.Tensor,
        lens: torch.Tensor,
    ) -> torch.Tensor | None:
        """Replay the step of ``len(ids)`` decodes (inputs on the device, ``tables`` [B, width]); the final
        hidden states [B, hidden], or None when no graph holds it (too many rows, too wide a table)."""
        n, width = tables.shape
        size = bucket_for(n, self.sizes)
        if size is None or size not in self._graphs or width > self.tables.shape[1]:
            return None
        self.ids[:n].copy_(ids)
        self.positions[:n].copy_(positions)
        self.slots[:n].copy_(slots)
        self.tables[:n, :width].copy_(tables)
        self.lens[:n].copy_(lens)
        if size > n:  # padding: the scratch block, one token
            self.ids[n:size].zero_()
            self.positions[n:size].zero_()
            self.slots[n:size].fill_(self._scratch_slot)
            self.tables[n:size, 0].fill_(self._scratch_block)
            self.lens[n:size].fill_(1)
        self._backend.replay(self._graphs[size])
        self.replays += 1
        return self.hidden[:n]


def try_capture(graphs: DecodeGraphs) -> DecodeGraphs | None:
    """Capture every bucket; on failure log why and return None (the engine then runs eagerly)."""
    try:
        graphs.capture()
    except Exception:  # a capture that fails must not take the engine down: eager still works
        log.warning("CUDA graph capture failed; decode steps run eagerly", exc_info=True)
        return None
    return graphs
