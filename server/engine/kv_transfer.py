"""Moving KV between engines instead of recomputing it (disaggregated serving, as in Mutel).

`read_kv` copies the KV of a run of a context's cached tokens out of the paged cache, every layer, into one
`KVBlob`; `write_kv` writes a blob into a context's next slots. Splitwise-style disaggregation moves a
prompt's whole KV to the decode instance this way (and back for the next turn); Mutel moves only what the
decode instance generated, once, when that is cheaper than recomputing it. Both run on the owning engine's
thread (`LLMEngine.export_kv`, `LLMEngine.import_kv`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from server.engine.context import Context, slot_indices


@dataclass(frozen=True)
class KVBlob:
    """The keys and values of ``token_ids`` in every layer: ``[layers, len(token_ids), kv_heads, dim]``."""

    token_ids: tuple[int, ...]
    k: torch.Tensor
    v: torch.Tensor

    @property
    def nbytes(self) -> int:
        """The bytes a transfer moves (keys and values; the token ids are negligible)."""
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()


def _slots(ctx: Context, start: int, end: int, block_size: int, device: torch.device) -> torch.Tensor:
    slots = slot_indices(ctx.block_table, start, end, block_size)
    return torch.tensor(slots, dtype=torch.int64, device=device)


def read_kv(
    k_caches: list[torch.Tensor], v_caches: list[torch.Tensor], ctx: Context, start: int, end: int
) -> KVBlob:
    """The KV of tokens ``[start, end)`` of ``ctx`` (all cached), copied out of the paged cache."""
    assert 0 <= start <= end <= ctx.num_cached, f"tokens [{start}, {end}) are not all cached"
    _, block_size, kv_heads, head_dim = k_caches[0].shape
    slots = _slots(ctx, start, end, block_size, k_caches[0].device)
    k = torch.stack([c.view(-1, kv_heads, head_dim).index_select(0, slots) for c in k_caches])
    v = torch.stack([c.view(-1, kv_heads, head_dim).index_select(0, slots) for c in v_caches])
    return KVBlob(tuple(ctx.token_ids[start:end]), k, v)


def write_kv(k_caches: list[torch.Tensor], v_caches: list[torch.Tensor], ctx: Context, blob: KVBlob) -> None:
    """Write ``blob`` into the slots of the next ``len(blob.token_ids)`` tokens of ``ctx``, which the caller
    reserved (`ContextTable.reserve`), and make them cached tokens of the context."""
    n = len(blob.token_ids)
    _, block_size, kv_heads, head_dim = k_caches[0].shape
    start = ctx.num_cached
    assert start == len(ctx.token_ids), "KV is imported only after the context's last cached token"
    slots = _slots(ctx, start, start + n, block_size, k_caches[0].device)
    for layer, (kc, vc) in enumerate(zip(k_caches, v_caches, strict=True)):
        kc.view(-1, kv_heads, head_dim).index_copy_(0, slots, blob.k[layer].to(kc.device, kc.dtype))
        vc.view(-1, kv_heads, head_dim).index_copy_(0, slots, blob.v[layer].to(vc.device, vc.dtype))
    ctx.token_ids.extend(blob.token_ids)
    ctx.num_cached += n
    ctx.last_hidden = None  # a generate from here recomputes the last token (`ContextTable.uncache_last`)
