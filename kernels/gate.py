"""When shared-prefix decode is worth it.

Grouping decoding sequences on their common prefix trades one multi-query pass over the prefix plus a merge
for ``members`` separate reads of it. With few members or a short prefix the extra launches (GPU) or the
extra pass and merge (CPU) cost more than the saved traffic, so the engine asks :func:`should_share_prefix`
per candidate group and leaves a group that fails ungrouped (``group_of = -1``, full context in its suffix
table). Results are identical either way; only speed differs.

Thresholds:

* CUDA (Triton kernels): at least 128 MiB of KV reads saved per layer. Measured on an H100 (bf16, 8 KV
  heads x 128 dims = 4 KiB per token, device time with the L2 cache flushed, `benchmarks.kernels`): the
  grouped pass was slower below that (8 sequences sharing 1k tokens, 29 MiB saved: 0.60x) and faster from
  about there on (8 x 4k, 117 MiB: 1.06x; 32 x 1k, 124 MiB: 1.18x; 64 x 1k: 1.34x; 64 x 4k: 2.48x). The
  former gate (8 members, 256 tokens) grouped steps the kernel made slower.
* CUDA, when the step replays a CUDA graph grouped or not (``graphed``; `server.engine.cuda_graphs` captures
  grouped steps too): at least 512 MiB saved per layer. Measured end to end on the H100
  (`benchmarks.gpu_steps`, Llama-2-7B shape, 16 KiB per token, forks of one prefix each with 128 tokens of
  its own, mean graphed decode step grouped against plain): 16 x 1k (240 MiB saved) 0.95x; 16 x 3,840
  (900 MiB) 1.32x; 64 x 1k (1,008 MiB) 1.28x; 64 x 3,840 (3.7 GiB) 2.49x. A graphed plain step reads the
  KV faster than the eager calls the 128 MiB crossover was timed on, so grouping pays later.
* CUDA, when the step would otherwise replay a CUDA graph and a grouped one cannot (``graphed`` without
  ``grouped_graphs``: the engine has no grouped graphs, their capture failed): at least 3 GiB saved per
  layer, since grouping then also pays for running the whole step eagerly. Measured end to end on the H100
  before grouped graphs existed (`benchmarks.gpu_steps`, same shape and workload, grouped-eager against
  graphed): 32 x 3,840 tokens, 1.9 GiB saved: 0.78-0.83x; 64 x 3,840, 3.7 GiB: 1.26-1.31x; everything
  smaller 0.40-0.60x (an eager 7B step cost ~25 ms against 10-22 ms graphed at these sizes).
* CPU, plain decode on the torch path: at least 2 members and at least 6 MiB of KV reads saved per layer,
  ``(members - 1) * prefix_len * kv_bytes_per_token``. Measured on 2 cores: the grouped pass costs a fixed
  ~0.2 ms per layer (prefix pass, merge), which plain decode spends reading about that much KV. With the
  default 8 KiB per token (8 KV heads x 128 dims x K and V x fp32) that is 768 saved tokens, e.g. 2
  members sharing 768 tokens or 4 sharing 256.
* CPU, plain decode in our C++ kernel (``cpu_kernel``; `kernels.cpu_kernels`): at least 8 members and at
  least 256 MiB of prefix KV re-read per layer by plain decode (``(members - 1) * prefix_len *
  kv_bytes_per_token``). The kernel re-reads a prefix of a few MiB from the CPU's caches on both cores, so
  grouping saves little traffic; it pays a gather and a merge for GEMMs in place of dot products. Measured on
  2 cores, whole decode steps of an engine with "always" against one with "never" (forks of one prefix, 4
  private tokens each), grouped over plain: SmolLM2 bf16 (768 B per token and layer) 4 x 4k 0.60, 8 x 1k
  0.59, 16 x 1k 0.72, 32 x 1k 0.64, 64 x 256 0.69, 64 x 1k 0.79, 16 x 2k 0.75, 32 x 2k 0.74, 16 x 4k 0.77,
  64 x 4k (189 MiB) 0.95, 64 x 7,680 (354 MiB) 1.16, 128 x 4k (381 MiB) 1.16; SmolLM2 fp32 (1.5 KiB): 16 x
  1k 0.80, 64 x 1k (95 MiB) 0.84, 64 x 4k (378 MiB) 1.11, 128 x 2k 1.10; the tiny model (fp32, 1 KiB): 32
  x 2k (62 MiB) 0.78, 64 x 1k 0.83, 64 x 4k (246 MiB) 1.29, 128 x 2k (254 MiB) 1.24, 128 x 4k (496 MiB)
  1.45. No one threshold separates all three models; 256 MiB is never slower, at the cost of the tiny
  model's 1.24-1.29x just below it. (Until the kernels were built with OpenMP they ran on one core, and
  grouping paid from 64k member-tokens, 1.3-2.3x: measured against a kernel at half its speed.)
"""

from __future__ import annotations

import torch

__all__ = [
    "CPU_KERNEL_MIN_MEMBERS",
    "CPU_KERNEL_MIN_SAVED_BYTES",
    "CPU_MIN_SAVED_BYTES",
    "CUDA_EAGER_GROUP_MIN_SAVED_BYTES",
    "CUDA_GRAPHED_MIN_SAVED_BYTES",
    "CUDA_MIN_SAVED_BYTES",
    "should_share_prefix",
]

CUDA_MIN_SAVED_BYTES = 128 << 20
CUDA_GRAPHED_MIN_SAVED_BYTES = 512 << 20
CUDA_EAGER_GROUP_MIN_SAVED_BYTES = 3 << 30
CPU_MIN_SAVED_BYTES = 6 << 20
CPU_KERNEL_MIN_MEMBERS = 8
CPU_KERNEL_MIN_SAVED_BYTES = 256 << 20
_DEFAULT_KV_BYTES_PER_TOKEN = 2 * 8 * 128 * 4


def should_share_prefix(
    num_members: int,
    prefix_len: int,
    device: torch.device | str,
    *,
    kv_bytes_per_token: int | None = None,
    graphed: bool = False,
    grouped_graphs: bool = True,
    cpu_kernel: bool = False,
) -> bool:
    """Whether ``num_members`` decoding sequences sharing ``prefix_len`` tokens should be grouped.

    Args:
        num_members: sequences of the batch that share the prefix.
        prefix_len: shared tokens (the engine shares whole blocks).
        device: where attention runs (``torch.device`` or a string such as ``"cuda:0"`` / ``"cpu"``).
        kv_bytes_per_token: K plus V bytes of one token in one layer
            (``2 * num_kv_heads * head_dim * element_size``); default 8 KiB.
        graphed: on CUDA, the step would otherwise replay a CUDA graph.
        grouped_graphs: with ``graphed``, a grouped step replays a graph too (else it runs eagerly).
        cpu_kernel: on CPU, plain decode runs our C++ kernel (else the torch path).
    """
    if num_members < 2 or prefix_len <= 0:
        return False
    saved = (num_members - 1) * prefix_len * (kv_bytes_per_token or _DEFAULT_KV_BYTES_PER_TOKEN)
    if torch.device(device).type == "cuda":
        if not graphed:
            return saved >= CUDA_MIN_SAVED_BYTES
        return saved >= (CUDA_GRAPHED_MIN_SAVED_BYTES if grouped_graphs else CUDA_EAGER_GROUP_MIN_SAVED_BYTES)
    if cpu_kernel:
        return num_members >= CPU_KERNEL_MIN_MEMBERS and saved >= CPU_KERNEL_MIN_SAVED_BYTES
    return saved >= CPU_MIN_SAVED_BYTES
