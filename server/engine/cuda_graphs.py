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

Pure decode steps only (no fill chunk, no remote KV replay); every other step runs eagerly
(`ModelRunner.run`). Steps whose sequences are grouped by shared prefix (`SharedPrefixGroups`) replay graphs
of their own, captured per bucket with up to `MAX_GRAPH_GROUPS` groups in static buffers (prefix tables and
lengths, each row's group; unused groups have length 0, padding rows group -1): the Triton shared-prefix
path takes every grid size from tensor shapes and never reads the grouping back on the host, so it records
as it is. Without them a grouped step ran eagerly, which on a 7B cost more than grouping saved below ~3 GiB
of prefix reads per layer (`kernels.gate`). Capturing is done by a `GraphBackend`: CUDA's on a GPU; tests on
CPU inject one that re-runs the recorded step, which checks the buffers and padding without a GPU.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from server.engine.attention import AttentionMetadata, DecodeBatch, SharedPrefixGroups
from server.engine.config import EngineConfig

__all__ = [
    "MAX_GRAPH_GROUPS",
    "CudaGraphBackend",
    "DecodeGraphs",
    "GraphBackend",
    "bucket_for",
    "graph_backend",
    "graph_batch_sizes",
    "try_capture",
]

log = logging.getLogger(__name__)

# Shared-prefix groups a grouped graph holds; a step with more runs eagerly.
MAX_GRAPH_GROUPS = 8

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
    """Static inputs and captured graphs per bucket (plain, and grouped by shared prefix); `run` replays a
    decode step of up to `max_batch` sequences."""

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
        max_groups: int | None = None,
    ) -> None:
        self.sizes = graph_batch_sizes(max_batch)
        self.max_batch = max_batch
        self.max_groups = max_groups = max_groups or MAX_GRAPH_GROUPS
        self._forward = forward
        self._backend = backend
        self._scratch_block = scratch_block
        self._scratch_slot = scratch_block * block_size
        i64, i32 = torch.int64, torch.int32
        width = max(1, max_blocks)
        self.ids = torch.zeros(max_batch, dtype=i64, device=device)
        self.positions = torch.zeros(max_batch, dtype=i64, device=device)
        self.slots = torch.full((max_batch,), self._scratch_slot, dtype=i64, device=device)
        # A grouped step's suffix tables.
        self.tables = torch.full((max_batch, width), scratch_block, dtype=i32, device=device)
        self.lens = torch.ones(max_batch, dtype=i32, device=device)
        self.prefix_tables = torch.full((max_groups, width), scratch_block, dtype=i32, device=device)
        self.prefix_lens = torch.zeros(max_groups, dtype=i32, device=device)
        self.group_of = torch.full((max_batch,), -1, dtype=i32, device=device)
        self.hidden = torch.zeros(max_batch, hidden_size, dtype=dtype, device=device)
        self._graphs: dict[int, Any] = {}
        self._grouped: dict[int, Any] = {}
        self.replays = 0  # steps served by a graph
        self.grouped_replays = 0  # of which grouped by shared prefix

    @property
    def has_grouped(self) -> bool:
        """Whether grouped steps replay graphs too."""
        return bool(self._grouped)

    def capture(self) -> None:
        """Run each bucket once eagerly (kernels compile outside the recording), then record it."""
        for size in reversed(self.sizes):
            self._step(size)
            self._graphs[size] = self._backend.capture(functools.partial(self._step, size))

    def capture_grouped(self) -> None:
        """The same for steps grouped by shared prefix (buckets of two rows or more); all or none."""
        try:
            for size in reversed([s for s in self.sizes if s >= 2]):
                self._step(size, grouped=True)
                self._grouped[size] = self._backend.capture(functools.partial(self._step, size, grouped=True))
        except BaseException:
            self._grouped.clear()
            raise

    def _step(self, size: int, grouped: bool = False) -> None:
        """What a graph holds: the forward over the static buffers' first ``size`` rows."""
        tables, lens = self.tables[:size], self.lens[:size]
        groups = (
            SharedPrefixGroups(self.prefix_tables, self.prefix_lens, self.group_of[:size], tables, lens)
            if grouped
            else None
        )
        meta = AttentionMetadata(
            slot_mapping=self.slots[:size],
            decode=DecodeBatch(block_tables=tables, context_lens=lens, groups=groups),
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
        groups: SharedPrefixGroups | None = None,
    ) -> torch.Tensor | None:
        """Replay the step of ``len(ids)`` decodes (inputs on the device, ``tables`` [B, width]; with
        ``groups``, their suffix tables and lengths are used instead); the final hidden states [B, hidden],
        or None when no graph holds it (too many rows or groups, too wide a table)."""
        if groups is not None:
            tables, lens = groups.suffix_block_tables, groups.suffix_lens
        n, width = tables.shape
        size = bucket_for(n, self.sizes)
        graphs = self._graphs if groups is None else self._grouped
        if size is None or size not in graphs or width > self.tables.shape[1]:
            return None
        if groups is not None and not self._load_groups(groups, n, size):
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
        self._backend.replay(graphs[size])
        self.replays += 1
        self.grouped_replays += groups is not None
        return self.hidden[:n]

    def _load_groups(self, groups: SharedPrefixGroups, n: int, size: int) -> bool:
        """Copy the grouping into the static buffers; False when they cannot hold it."""
        count, width = groups.prefix_block_tables.shape
        if count > self.max_groups or width > self.prefix_tables.shape[1]:
            return False
        self.prefix_tables[:count, :width].copy_(groups.prefix_block_tables)
        self.prefix_lens[:count].copy_(groups.prefix_lens)
        self.prefix_lens[count:].zero_()  # unused groups: no members, nothing to read
        self.group_of[:n].copy_(groups.group_of)
        self.group_of[n:size].fill_(-1)  # padding rows: plain decode over the scratch block
        return True


def try_capture(graphs: DecodeGraphs, grouped: bool = True) -> DecodeGraphs | None:
    """Capture every bucket (and, with ``grouped``, the grouped ones); on failure log why and return None
    (the engine then runs eagerly). A failed grouped capture leaves the plain graphs: grouped steps then run
    eagerly."""
    try:
        graphs.capture()
    except Exception:  # a capture that fails must not take the engine down: eager still works
        log.warning("CUDA graph capture failed; decode steps run eagerly", exc_info=True)
        return None
    if grouped:
        try:
            graphs.capture_grouped()
        except Exception:
            log.warning("CUDA graph capture of grouped steps failed; they run eagerly", exc_info=True)
    return graphs
