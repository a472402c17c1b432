"""A step of fresh fills (prompts with nothing cached), one layer's attention two ways: the length groups of
`server.engine.fresh_prefill` (padded batched calls, their rows gathered) and the one variable-length
FlashAttention call of `server.engine.fresh_plan` (`FreshVarlen`), both called directly, no switch involved.

The fifth H100 run found the grouped fill of 256 SmolLM2-shaped prompts host-bound (the groups' gathers and
copies in Python), so each way is timed as the engine thread sees it: the wall time of one layer's attention
(launches included, the device synchronised after) and, on CUDA, its device time; plus the wall time of
making the step's plan, which the engine does once per step for all its layers. q/k/v are column views of
one projection output, as the engine passes them. Where the varlen call does not apply (CPU, float32, a
head dim it lacks) the row says so and times the groups alone.
"""

from __future__ import annotations

import functools
import random
import statistics
from collections.abc import Callable, Sequence
from typing import Any

import torch

from benchmarks.harness.kernel_timing import interleaved, wall_ms
from server.engine.attention import PrefillChunk
from server.engine.config import ModelConfig
from server.engine.fresh_plan import FreshPlan, FreshVarlen, attend_fresh, plan_fresh
from server.engine.fresh_prefill import fresh_groups

__all__ = ["fresh_fill_ab", "step_chunks"]


def step_chunks(batch: int, shortest: int, longest: int, seed: int = 0) -> list[PrefillChunk]:
    """``batch`` fresh chunks of ``shortest``-``longest`` tokens laid back to back, as a step holds them."""
    rng = random.Random(seed)
    chunks, start = [], 0
    for _ in range(batch):
        n = rng.randint(shortest, longest)
        chunks.append(PrefillChunk(start, n, 0, torch.empty(0, dtype=torch.int64)))
        start += n
    return chunks


def fresh_fill_ab(
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    batches: Sequence[int],
    lengths: tuple[int, int],
    repeats: int = 20,
) -> list[dict[str, Any]]:
    """Per batch: each way's median wall and device ms of one layer, its plan's wall ms, the attention of a
    whole fill step both ways (plan + every layer) and groups over varlen, the outputs' largest difference."""
    return [_fill_step(cfg, dtype, device, step_chunks(batch, *lengths), repeats) for batch in batches]


def _fill_step(
    cfg: ModelConfig, dtype: torch.dtype, device: torch.device, chunks: list[PrefillChunk], repeats: int
) -> dict[str, Any]:
    heads, kv_heads, dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    total = chunks[-1].token_start + chunks[-1].num_tokens
    qkv = torch.randn(total, (heads + 2 * kv_heads) * dim, dtype=dtype, device=device)
    q = qkv[:, : heads * dim].view(total, heads, dim)
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(total, kv_heads, dim)
    v = qkv[:, (heads + kv_heads) * dim :].view(total, kv_heads, dim)
    plans: dict[str, Callable[[], FreshPlan]] = {
        "groups": functools.partial(fresh_groups, chunks, device),
        "varlen": functools.partial(plan_fresh, chunks, q, k),
    }
    row: dict[str, Any] = {"batch": len(chunks), "tokens": total, "layers": cfg.num_hidden_layers}
    made = {name: plan() for name, plan in plans.items()}
    if not isinstance(made["varlen"], FreshVarlen):
        row["varlen"] = f"not taken on {device.type} in {dtype}"
        del plans["varlen"], made["varlen"]
    outs = {name: torch.empty_like(q) for name in plans}
    calls = [functools.partial(attend_fresh, q, k, v, made[n], dim**-0.5, outs[n]) for n in plans]
    for call in calls:
        call()  # the warm-up (and any one-time check)
    if "varlen" in outs:
        row["max_abs_error"] = (outs["varlen"].float() - outs["groups"].float()).abs().max().item()
    timed = interleaved(calls, repeats, device)
    for name, plan, ms, wall in zip(plans, plans.values(), timed.ms, timed.wall_ms, strict=True):
        row[f"{name}_ms"] = statistics.median(ms)
        row[f"{name}_wall_ms"] = statistics.median(wall)
        row[f"{name}_plan_ms"] = statistics.median(wall_ms(plan, device) for _ in range(repeats))
        row[f"{name}_step_ms"] = row[f"{name}_plan_ms"] + cfg.num_hidden_layers * row[f"{name}_wall_ms"]
    if "varlen" in plans:
        row["groups_over_varlen"] = row["groups_step_ms"] / row["varlen_step_ms"]
    return row
