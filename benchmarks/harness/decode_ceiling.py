"""The batch-1 decode ceiling: memory read bandwidth over the weight bytes one decode step reads.

At batch 1 a decode step reads every weight once and computes little on each, so no engine can decode
faster than the machine reads its weights; a measured rate is reported as a share of that bound.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from benchmarks.harness.stats import safe_ratio

__all__ = ["Ceiling", "decode_ceiling", "decode_weight_bytes"]


def decode_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of weights one batch-1 decode step reads: every parameter once (a tied embedding is the
    output head's matrix, read whole), except an untied embedding table, of which it reads one row."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())  # shared tensors once
    cfg = getattr(model, "config", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if embed is not None and not getattr(cfg, "tie_word_embeddings", True):
        weight = embed.weight
        total -= weight.numel() * weight.element_size() - weight.shape[1] * weight.element_size()
    return total


@dataclass
class Ceiling:
    """The batch-1 decode rate memory bandwidth allows, and a measured rate against it."""

    read_bytes_per_s: (
        float  # median memory read bandwidth (see `benchmarks.harness.machine.memory_bandwidth`)
    )
    weight_bytes: int  # read per decode step (`decode_weight_bytes`)
    dtype: str
    ceiling_tps: float  # read_bytes_per_s / weight_bytes
    decode_b1_tps: float  # the measured batch-1 decode rate (NaN: not measured)
    share: float  # decode_b1_tps / ceiling_tps
    bandwidth: dict[str, float | int]


def decode_ceiling(
    bandwidth: dict[str, float | int], model: torch.nn.Module, dtype: str, decode_b1_tps: float
) -> Ceiling:
    """``decode_b1_tps`` against memory bandwidth (`benchmarks.harness.machine.memory_bandwidth`) / the weight
    bytes one step of ``model`` reads."""
    read, weights = float(bandwidth["read_bytes_per_s"]), decode_weight_bytes(model)
    ceiling = safe_ratio(read, weights)
    return Ceiling(
        read, weights, dtype, ceiling, decode_b1_tps, safe_ratio(decode_b1_tps, ceiling), bandwidth
    )
