"""When shared-prefix decode is worth it.

Grouping decoding sequences on their common prefix trades one multi-query pass over the prefix plus a merge
for ``members`` separate reads of it. With few members or a short prefix the extra launches (GPU) or the
extra pass and merge (CPU) cost more than the saved traffic, so the engine asks :func:`should_share_prefix`
per candidate group and leaves a group that fails ungrouped (``group_of = -1``, full context in its suffix
table). Results are identical either way; only speed differs.

Thresholds:

* CUDA (Triton kernels): at least 8 members and a prefix of at least 256 tokens. Below that a plain paged
  decode launch already fills the GPU and the prefix is cheap to read.
* CPU (torch path): at least 2 members and at least 6 MiB of KV reads saved per layer,
  ``(members - 1) * prefix_len * kv_bytes_per_token``. Measured on 2 cores: the grouped pass costs a fixed
  ~0.2 ms per layer (prefix pass, merge), which plain decode spends reading about that much KV. With the
  default 8 KiB per token (8 KV heads x 128 dims x K and V x fp32) that is 768 saved tokens, e.g. 2
  members sharing 768 tokens or 4 sharing 256.
"""

from __future__ import annotations

import torch

__all__ = [
    "CPU_MIN_SAVED_BYTES",
    "CUDA_MIN_MEMBERS",
    "CUDA_MIN_PREFIX",
    "should_share_prefix",
]

CUDA_MIN_MEMBERS = 8
CUDA_MIN_PREFIX = 256
CPU_MIN_SAVED_BYTES = 6 << 20
_DEFAULT_KV_BYTES_PER_TOKEN = 2 * 8 * 128 * 4


def should_share_prefix(
    num_members: int,
    prefix_len: int,
    device: torch.device | str,
    *,
    kv_bytes_per_token: int | None = None,
) -> bool:
    """Whether ``num_members`` decoding sequences sharing ``prefix_len`` tokens should be grouped.

    Args:
        num_members: sequences of the batch that share the prefix.
        prefix_len: shared tokens (the engine shares whole blocks).
        device: where attention runs (``torch.device`` or a string such as ``"cuda:0"`` / ``"cpu"``).
        kv_bytes_per_token: K plus V bytes of one token in one layer
            (``2 * num_kv_heads * head_dim * element_size``); used on CPU, default 8 KiB.
    """
    if num_members < 2 or prefix_len <= 0:
        return False
    if torch.device(device).type == "cuda":
        return num_members >= CUDA_MIN_MEMBERS and prefix_len >= CUDA_MIN_PREFIX
    per_token = kv_bytes_per_token or _DEFAULT_KV_BYTES_PER_TOKEN
    return (num_members - 1) * prefix_len * per_token >= CPU_MIN_SAVED_BYTES
