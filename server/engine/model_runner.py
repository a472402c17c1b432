"""Turns a scheduled step into tensors, runs the model over the paged cache and returns sampling inputs."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

import kernels
from kernels import cpu_kernels
from kernels.device_tensors import device_tensor
from server.engine import cuda_graphs
from server.engine.attention import (
    AttentionBackend,
    AttentionMetadata,
    DecodeBatch,
    PagedAttentionBackend,
    PrefillChunk,
    SharedPrefixGroups,
    pad_tables,
)
from server.engine.config import EngineConfig, ModelConfig, step_activation_bytes
from server.engine.context import Context, blocks_for, slot_indices
from server.engine.cuda_graphs import DecodeGraphs, GraphBackend, try_capture
from server.engine.model import LlamaForCausalLM
from server.engine.prefill_rows import EVERY_CHUNK, MAX_CONTEXT
from server.engine.remote_kv import RemoteRows, build_remote_rows
from server.engine.scheduler import ScheduledChunk


class KVCache:
    """Per-layer K and V block pools, [num_blocks, block_size, num_kv_heads, head_dim] each."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(num_layers)]

    @staticmethod
    def bytes_per_block(
        num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        return 2 * num_layers * block_size * num_kv_heads * head_dim * dtype.itemsize

    def copy_block(self, src: int, dst: int) -> None:
        for k, v in zip(self.k, self.v, strict=True):
            k[dst].copy_(k[src])
            v[dst].copy_(v[src])


def shared_prefix_blocks(tables: list[list[int]], full_blocks: list[int]) -> int:
    """Leading blocks that every table in a group has in common, capped at each member's full blocks."""
    first = tables[0]
    lcp = min(full_blocks)
    for t in tables[1:]:
        if t[:lcp] == first[:lcp]:
            continue
        lo, hi = 0, lcp  # the prefixes equal up to some length: binary search it with C-speed slices
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if t[:mid] == first[:mid]:
                lo = mid
            else:
                hi = mid - 1
        lcp = lo
    return lcp


@dataclass(frozen=True)
class GraphSettings:
    """How decode steps are captured as graphs: up to ``max_batch`` sequences, contexts up to
    ``max_model_len`` tokens, padding rows aimed at ``scratch_block`` (a KV block no context owns)."""

    backend: GraphBackend
    max_batch: int
    max_model_len: int
    scratch_block: int


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kv: KVCache,
        block_size: int,
        device: torch.device,
        shared_prefix_decode: Literal["auto", "always", "never"] = "auto",
        backend: AttentionBackend | None = None,
        graphs: GraphSettings | None = None,
        batch_invariant: bool = False,
    ) -> None:
        self.model = model
        self.kv = kv
        self.block_size = block_size
        self.device = device
        self.shared_prefix_decode = "never" if batch_invariant else shared_prefix_decode
        self.backend = backend or PagedAttentionBackend(EVERY_CHUNK if batch_invariant else MAX_CONTEXT)
        model.prepare_weights(batch_invariant)  # one GEMM for q/k/v and one for gate/up, packed where it pays
        k = kv.k[0]
        self._kv_bytes_per_token = 2 * k.shape[2] * k.shape[3] * k.element_size()
        # Plain CPU decode in our C++ kernel (built, or found in the cache, now rather than in the first
        # step) moves the point where grouping shared prefixes pays (`kernels.should_share_prefix`).
        self._cpu_decode_kernel = (
            device.type == "cpu"
            and cpu_kernels.paged_decode_kernel() is not None
            and cpu_kernels.decode_kernel_covers(
                model.config.num_attention_heads, k.shape[2], k.shape[3], k.shape[1]
            )
        )
        if batch_invariant and (why := _not_invariant(model, device, self._cpu_decode_kernel)):
            raise ValueError(f"batch_invariant needs {why}")
        self.grouped_decode_steps = 0  # decode steps that took the shared-prefix path
        # The last step's rows attended over remote KV (None: none), read by the engine after `run` for
        # the bytes exchanged and the contexts whose KV holder was lost.
        self.remote_rows: RemoteRows | None = None
        self.scored_rows: dict[int, torch.Tensor] = {}  # a scoring fill's chunk's rows, by batch index
        # Pure decode steps replayed as CUDA graphs (`cuda_graphs`); None: every step runs eagerly.
        self.graphs = self._capture_graphs(graphs) if graphs is not None else None

    def _capture_graphs(self, settings: GraphSettings) -> DecodeGraphs | None:
        cfg = self.model.config
        graphs = DecodeGraphs(
            lambda ids, positions, meta: self.model(ids, positions, self.kv.k, self.kv.v, meta, self.backend),
            max_batch=settings.max_batch,
            max_blocks=blocks_for(settings.max_model_len, self.block_size),
            block_size=self.block_size,
            scratch_block=settings.scratch_block,
            hidden_size=cfg.hidden_size,
            dtype=self.kv.k[0].dtype,
            device=self.device,
            backend=settings.backend,
        )
        return try_capture(graphs, grouped=self.shared_prefix_decode != "never")

    def run(self, batch: list[ScheduledChunk]) -> torch.Tensor:
        """Run the step; return the final hidden state of each chunk's last token ([len(batch), hidden]).

        Chunks of 0 tokens take the context's stored hidden state. Only the rows the caller samples or keeps
        are ever projected to logits (`logits`).
        """
        # Rows: local decodes, then every token of remote-prefixed contexts, then local fill chunks.
        remote = [c for c in batch if c.num_tokens > 0 and c.request.context.remote is not None]
        local = [c for c in batch if c.request.context.remote is None]
        decodes = [c for c in local if c.num_tokens == 1]
        prefills = [c for c in local if c.num_tokens > 1]
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        bs = self.block_size
        for c in decodes + remote + prefills:
            ctx = c.request.context
            start, end = ctx.num_cached, ctx.num_cached + c.num_tokens
            ids.extend(ctx.token_ids[start:end])
            positions.extend(range(start + ctx.position_offset, end + ctx.position_offset))
            slots.extend(slot_indices(ctx.block_table, start, end, bs))
        last_row: dict[int, int] = {}
        hidden = None
        self.remote_rows = None
        self.scored_rows = {}
        if ids:
            meta = AttentionMetadata(
                slot_mapping=device_tensor(slots, torch.int64, self.device),
                decode=self._decode_batch(decodes, graphable=len(decodes) == len(batch)) if decodes else None,
                prefills=[],
            )
            if len(decodes) == len(batch) and self.graphs is not None:
                replayed = self._replay(meta, ids, positions)
                if replayed is not None:
                    return replayed
            row = len(decodes)
            for i, c in enumerate(decodes):
                last_row[id(c)] = i
            if remote:
                meta.remote = self.remote_rows = self._remote_rows(remote, row)
                row += sum(c.num_tokens for c in remote)
                last_row.update(_last_rows(remote, len(decodes)))
            for c in prefills:
                ctx = c.request.context
                n_blocks = blocks_for(ctx.num_cached + c.num_tokens, bs)
                table = device_tensor(ctx.block_table[:n_blocks], torch.int64, self.device)
                meta.prefills.append(PrefillChunk(row, c.num_tokens, ctx.num_cached, table))
                row += c.num_tokens
                last_row[id(c)] = row - 1
            # Only the rows read out go through the final norm: one per chunk, in batch order, or each of a
            # scoring fill's chunk's tokens.
            rows, lasts, spans = _readout(batch, last_row)
            hidden = self.model(
                device_tensor(ids, torch.int64, self.device),
                device_tensor(positions, torch.int64, self.device),
                self.kv.k,
                self.kv.v,
                meta,
                self.backend,
                None if rows == list(range(len(ids))) else device_tensor(rows, torch.int64, self.device),
            )
            if spans:
                self.scored_rows = {i: hidden[a:b] for i, (a, b) in spans.items()}
                hidden = hidden[device_tensor(lasts, torch.int64, self.device)]
        if all(c.num_tokens > 0 for c in batch):
            return hidden if hidden is not None else torch.empty(0)
        out, read = [], 0
        for c in batch:
            if c.num_tokens == 0:
                stored = c.request.context.last_hidden
                # A generate never starts without it: `LLMEngine._start` un-caches the last token instead.
                assert stored is not None, "a 0-token chunk needs its context's stored last hidden state"
                out.append(stored)
            else:
                assert hidden is not None
                out.append(hidden[read])
                read += 1
        return torch.stack(out)

    def _replay(self, meta: AttentionMetadata, ids: list[int], positions: list[int]) -> torch.Tensor | None:
        """A pure decode step through its CUDA graph (grouped by shared prefix or not); None when no graph
        holds it (the caller then runs it eagerly)."""
        decode = meta.decode
        assert decode is not None and self.graphs is not None
        return self.graphs.run(
            device_tensor(ids, torch.int64, self.device),
            device_tensor(positions, torch.int64, self.device),
            meta.slot_mapping,
            decode.block_tables,
            decode.context_lens,
            decode.groups,
        )

    def _remote_rows(self, chunks: list[ScheduledChunk], first_row: int) -> RemoteRows:
        """Each token of each chunk is a query row over its local keys up to itself plus the remote prefix."""
        rows = []
        row = first_row
        for c in chunks:
            ctx = c.request.context
            assert ctx.remote is not None
            seen = ctx.num_cached + c.num_tokens
            table = ctx.block_table[: blocks_for(seen, self.block_size)]
            for p in range(ctx.num_cached, seen):
                rows.append((row, p + 1, table, ctx.remote, ctx.context_id))
                row += 1
        return build_remote_rows(rows, self.device)

    def wait_for_device(self) -> None:
        """Block until the device has finished the work queued so far (a no-op on CPU)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden)

    def _decode_batch(self, decodes: list[ScheduledChunk], graphable: bool = False) -> DecodeBatch:
        """The decode rows' tables and lengths, grouped by shared prefix where that pays; ``graphable``: the
        step is decodes alone, so ungrouped it would replay a CUDA graph (which grouping must outweigh)."""
        ctxs = [c.request.context for c in decodes]
        lens = [ctx.num_cached + 1 for ctx in ctxs]
        tables = [
            ctx.block_table[: blocks_for(n, self.block_size)] for ctx, n in zip(ctxs, lens, strict=True)
        ]
        batch = DecodeBatch(
            block_tables=pad_tables(tables, self.device), context_lens=_int32(lens, self.device), groups=None
        )
        if self.shared_prefix_decode != "never" and len(ctxs) > 1:
            graphed = graphable and self.graphs is not None and len(ctxs) <= self.graphs.max_batch
            batch.groups = self._group(ctxs, tables, lens, graphed)
            self.grouped_decode_steps += batch.groups is not None
        return batch

    def _worth_grouping(self, members: int, prefix_len: int, graphed: bool) -> bool:
        if self.shared_prefix_decode == "always":
            return True
        return kernels.should_share_prefix(
            members,
            prefix_len,
            self.device,
            kv_bytes_per_token=self._kv_bytes_per_token,
            graphed=graphed,
            grouped_graphs=self.graphs is not None and self.graphs.has_grouped,
            cpu_kernel=self._cpu_decode_kernel,
        )

    def _group(
        self, ctxs: list[Context], tables: list[list[int]], lens: list[int], graphed: bool = False
    ) -> SharedPrefixGroups | None:
        # Sequences whose first block is the same physical block share a prefix; its length is the longest
        # run of identical leading blocks, full in every member (a block someone writes is never shared).
        by_first: dict[int, list[int]] = defaultdict(list)
        for i, t in enumerate(tables):
            by_first[t[0]].append(i)
        group_of = [-1] * len(ctxs)
        prefix_tables: list[list[int]] = []
        prefix_lens: list[int] = []
        for members in by_first.values():
            if len(members) < 2:
                continue
            full = [ctxs[i].num_cached // self.block_size for i in members]
            n = shared_prefix_blocks([tables[i] for i in members], full)
            if n == 0 or not self._worth_grouping(len(members), n * self.block_size, graphed):
                continue
            for i in members:
                group_of[i] = len(prefix_tables)
            prefix_tables.append(tables[members[0]][:n])
            prefix_lens.append(n * self.block_size)
        if not prefix_tables:
            return None
        suffix_tables, suffix_lens = [], []
        for i, t in enumerate(tables):
            g = group_of[i]
            skip = 0 if g < 0 else len(prefix_tables[g])
            suffix_tables.append(t[skip:])
            suffix_lens.append(lens[i] - skip * self.block_size)
        return SharedPrefixGroups(
            prefix_block_tables=pad_tables(prefix_tables, self.device),
            prefix_lens=_int32(prefix_lens, self.device),
            group_of=_int32(group_of, self.device),
            suffix_block_tables=pad_tables(suffix_tables, self.device),
            suffix_lens=_int32(suffix_lens, self.device),
        )


def _not_invariant(model: LlamaForCausalLM, device: torch.device, decode_kernel: bool) -> str | None:
    """What keeps ``model``'s steps from being batch invariant here (`EngineConfig.batch_invariant`); None
    when nothing does."""
    if device.type != "cpu":
        return "a CPU engine (on a GPU, fill and decode attention sum in an order that depends on the step)"
    if not decode_kernel:
        return "our C++ paged decode kernel for these shapes (kernels/csrc, built at start; see its log)"
    if not all(p is not None and p.dim() == 4 for p in model.packed_linears()):
        return (
            "every linear in our packed bf16 GEMM: dtype bfloat16 on a CPU with native bf16 and our C++ "
            "kernels built (other GEMMs sum a row differently at other row counts)"
        )
    return None


def _last_rows(chunks: list[ScheduledChunk], first_row: int) -> dict[int, int]:
    last, row = {}, first_row
    for c in chunks:
        row += c.num_tokens
        last[id(c)] = row - 1
    return last


def _int32(values: list[int], device: torch.device) -> torch.Tensor:
    return device_tensor(values, torch.int32, device)


def build_runner(
    model: LlamaForCausalLM, model_config: ModelConfig, config: EngineConfig
) -> tuple[ModelRunner, int, Callable[[int, int], None]]:
    """``model``'s runner over a KV cache sized by ``config`` (its ``num_kv_blocks``, else what the memory
    budget leaves after the weights and a step's activations), with CUDA graphs where they apply; returns it,
    the cache's allocatable blocks and the cache's block copy (for copy-on-write forks)."""
    device, dtype = config.torch_device(), config.torch_dtype()
    num_blocks = config.num_kv_blocks or max(
        1,
        config.kv_cache_bytes(model.num_bytes(), step_activation_bytes(model_config, config, dtype))
        // KVCache.bytes_per_block(
            model_config.num_hidden_layers,
            config.block_size,
            model_config.num_key_value_heads,
            model_config.head_dim,
            dtype,
        ),
    )
    graph_backend = cuda_graphs.graph_backend(config)
    kv = KVCache(
        model_config.num_hidden_layers,
        num_blocks + (graph_backend is not None),  # the last: graphs' scratch block, never allocated
        config.block_size,
        model_config.num_key_value_heads,
        model_config.head_dim,
        device,
        dtype,
    )
    graphs = None
    if graph_backend is not None:
        max_len = config.model_len(model_config)
        graphs = GraphSettings(graph_backend, config.max_num_seqs, max_len, scratch_block=num_blocks)
    runner = ModelRunner(
        model,
        kv,
        config.block_size,
        device,
        config.shared_prefix_decode,
        graphs=graphs,
        batch_invariant=config.batch_invariant,
    )
    return runner, num_blocks, kv.copy_block


def _readout(
    batch: list[ScheduledChunk], last_row: dict[int, int]
) -> tuple[list[int], list[int], dict[int, tuple[int, int]]]:
    """The rows a step reads out, in batch order: each chunk's last, or every row of a scoring fill's chunk;
    where each chunk's last row is among them; and each scoring chunk's span of them, by batch index."""
    rows: list[int] = []
    lasts: list[int] = []
    spans: dict[int, tuple[int, int]] = {}
    for i, c in enumerate(batch):
        if c.num_tokens == 0:
            continue
        last = last_row[id(c)]
        if c.request.prompt_logprobs is not None and c.num_tokens > 1:
            first = len(rows)
            rows.extend(range(last - c.num_tokens + 1, last + 1))
            spans[i] = (first, len(rows))
        else:
            rows.append(last)
        lasts.append(len(rows) - 1)
    return rows, lasts, spans
