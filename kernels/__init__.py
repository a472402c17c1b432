"""Attention over a paged KV cache: plain paged decode, shared-prefix decode, the LSE merge, and a fill
chunk's causal attention read in place (`paged_prefill_attention`, Triton or the reference: off CUDA the
engine gathers the context instead).

KV cache layout, per layer: ``k_cache``, ``v_cache`` of shape ``[num_blocks, block_size, num_kv_heads,
head_dim]``. Token ``t`` of a sequence is in block ``block_table[t // block_size]``, slot
``t % block_size``; query head ``h`` reads KV head ``h // (num_heads // num_kv_heads)``.

Every function takes ``backend=``:

* ``"auto"`` (default): the Triton kernels for CUDA tensors when triton is installed, else the torch path
  (the reference for `paged_prefill_attention`, which has none); `resolve_backend` says which;
* ``"triton"``: the Triton kernels (on CPU tensors this needs ``TRITON_INTERPRET=1`` set before triton is
  first imported — the tests do this);
* ``"torch"``: the torch form of the same two-phase algorithm (what the engine runs on CPU);
* ``"reference"``: the plain, slow specification in :mod:`kernels.reference`.

Importing this package imports neither torch nor triton (a command line reads `kernels.settings` before it
loads a model); triton is loaded on the first Triton call.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:  # importing the package (its settings, by the command lines) does not import torch
    import torch

    from kernels.gate import should_share_prefix

__all__ = [
    "Backend",
    "merge_attention_states",
    "paged_decode_attention",
    "paged_prefill_attention",
    "resolve_backend",
    "shared_prefix_decode_attention",
    "should_share_prefix",
    "triton_available",
]

Backend = Literal["auto", "triton", "torch", "reference"]


@functools.cache
def triton_available() -> bool:
    """Whether triton is installed (checked without importing it)."""
    return importlib.util.find_spec("triton") is not None


# Where each entry point's backends live. One table, read by `resolve_backend` alone, so no entry point
# can send a backend to a module that lacks its function: a test resolves every op for every device.
_PATHS: dict[str, dict[str, str]] = {
    "paged_decode_attention": {
        "triton": "kernels.triton_kernels",
        "torch": "kernels.torch_path",
        "reference": "kernels.reference",
    },
    "shared_prefix_decode_attention": {
        "triton": "kernels.triton_kernels",
        "torch": "kernels.torch_path",
        "reference": "kernels.reference",
    },
    "merge_attention_states": {
        "triton": "kernels.triton_kernels",
        "torch": "kernels.torch_path",
        "reference": "kernels.reference",
    },
    # No torch path: off CUDA the engine gathers the context (`server.engine.attention.gathered_prefill`).
    "paged_prefill_attention": {"triton": "kernels.triton_prefill", "reference": "kernels.reference"},
}


def resolve_backend(op: str, backend: Backend, device: torch.device) -> tuple[Backend, str]:
    """The concrete backend ``op`` runs with for tensors on ``device``, and the module that holds it.

    ``"auto"``: Triton for CUDA tensors where triton is installed, else the torch path, else (an op with
    none) the reference. Raises `ValueError` for an unknown op or backend, or one the op does not have.
    """
    paths = _PATHS.get(op)
    if paths is None:
        raise ValueError(f"unknown attention op {op!r}")
    if backend == "auto":
        backend = "triton" if device.type == "cuda" and triton_available() else "torch"
        if backend not in paths:
            backend = "reference"
    if backend not in ("triton", "torch", "reference"):
        raise ValueError(f"unknown attention backend {backend!r}")
    if backend not in paths:
        raise ValueError(f"{op} has no {backend} path: use one of {', '.join(['auto', *paths])}")
    return backend, paths[backend]


def _op(op: str, backend: Backend, device: torch.device) -> Callable[..., Any]:
    """The function ``op`` of its resolved backend (triton's modules are imported on first use: slow)."""
    _, module = resolve_backend(op, backend, device)
    return getattr(importlib.import_module(module), op)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    backend: Backend = "auto",
) -> torch.Tensor:
    """Decode attention of one query token per sequence over its paged KV cache.

    Args:
        q: ``[B, H, D]`` queries (fp16/bf16/fp32).
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, D]``; ``H`` a multiple of ``num_kv_heads``.
        block_tables: ``[B, max_blocks]`` int32 block ids; slots past a sequence's length are ignored.
        context_lens: ``[B]`` int32 tokens per sequence (0 gives a zero output).
        scale: softmax scale, usually ``D ** -0.5``.

    Returns:
        ``[B, H, D]`` in ``q.dtype``.
    """
    return _op("paged_decode_attention", backend, q.device)(
        q, k_cache, v_cache, block_tables, context_lens, scale
    )


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
    backend: Backend = "auto",
) -> torch.Tensor:
    """Decode attention where groups of sequences share prefix blocks: the prefix KV is read once per group.

    Sequence ``b`` attends to the ``prefix_lens[g]`` tokens of ``prefix_block_tables[g]`` (``g =
    group_of[b]``), then to the ``suffix_lens[b]`` tokens of its own ``suffix_block_tables[b]``. With
    ``group_of[b] == -1`` it has no shared prefix and the suffix table holds its whole context. Any number of
    groups; prefix lengths need not be whole blocks; a suffix may be empty. The result equals
    :func:`paged_decode_attention` over the concatenated tables.

    Args:
        q: ``[B, H, D]``.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, D]``.
        prefix_block_tables: ``[G, max_prefix_blocks]`` int32; prefix_lens: ``[G]`` int32.
        group_of: ``[B]`` int32 group of each sequence, ``-1`` for none.
        suffix_block_tables: ``[B, max_suffix_blocks]`` int32; suffix_lens: ``[B]`` int32.
        scale: softmax scale.

    Returns:
        ``[B, H, D]`` in ``q.dtype``.
    """
    return _op("shared_prefix_decode_attention", backend, q.device)(
        q,
        k_cache,
        v_cache,
        prefix_block_tables,
        prefix_lens,
        group_of,
        suffix_block_tables,
        suffix_lens,
        scale,
    )


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    num_cached: int,
    scale: float,
    *,
    backend: Backend = "auto",
) -> torch.Tensor:
    """Causal attention of a fill chunk over its context in the paged cache, read in place (no gather).

    Row ``i`` of ``q`` attends to tokens ``[0, num_cached + i]`` of ``block_table``: the cached context and
    the chunk's own tokens up to itself, whose K/V must already be written.

    Args:
        q: ``[n, H, D]`` the chunk's queries.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, D]``.
        block_table: ``[blocks]`` the context's block ids (int32 or int64), covering ``num_cached + n``.
        num_cached: tokens before the chunk.
        scale: softmax scale.

    Backends: ``"triton"`` (``"auto"`` on CUDA) and ``"reference"`` (``"auto"`` elsewhere); there is no
    torch path, since off CUDA the engine gathers the context (`server.engine.attention.gathered_prefill`).

    Returns:
        ``[n, H, D]`` in ``q.dtype``.
    """
    return _op("paged_prefill_attention", backend, q.device)(
        q, k_cache, v_cache, block_table, num_cached, scale
    )


def merge_attention_states(
    out_a: torch.Tensor,
    lse_a: torch.Tensor,
    out_b: torch.Tensor,
    lse_b: torch.Tensor,
    *,
    backend: Backend = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exactly combine two attention results over disjoint key sets, in float32.

    Args:
        out_a, out_b: ``[..., D]`` normalised partial outputs.
        lse_a, lse_b: ``[...]`` natural-log log-sum-exp of each partial's scaled scores; ``-inf`` marks an
            empty partial, whose output is then ignored (it may hold anything).

    Returns:
        ``(out, lse)``: ``out`` in ``out_a.dtype`` (0 where both are empty), ``lse`` float32.
    """
    return _op("merge_attention_states", backend, out_a.device)(out_a, lse_a, out_b, lse_b)


def __getattr__(name: str) -> Any:
    """`should_share_prefix`, from `kernels.gate` (which imports torch) on first use."""
    if name == "should_share_prefix":
        from kernels.gate import should_share_prefix

        globals()[name] = should_share_prefix  # later reads find it without this hook
        return should_share_prefix
    raise AttributeError(f"module 'kernels' has no attribute {name!r}")
