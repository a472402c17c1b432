"""How vLLM is run beside our engine: its command-line flags (`add_vllm_flags`) and its process
environment (`vllm_env`), set so the comparison is even on CPU — as many OpenMP threads on the same cores
as our process computes with, and a KV cache that holds the largest batch."""

from __future__ import annotations

import argparse
import json
import math
import os
from collections.abc import Sequence
from typing import Any

import torch

from benchmarks.harness.generators import DTYPES

__all__ = ["add_vllm_flags", "cpu_list", "kv_cache_gib", "vllm_env"]


def cpu_list(cpus: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"`` (the form of ``VLLM_CPU_OMP_THREADS_BIND``)."""
    runs: list[list[int]] = []
    for cpu in sorted(set(cpus)):
        if runs and cpu == runs[-1][-1] + 1:
            runs[-1].append(cpu)
        else:
            runs.append([cpu])
    return ",".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs)


def kv_cache_gib(model_config: Any, dtype: str, tokens: int) -> int:
    """Whole GiB of KV cache that hold ``tokens`` tokens in ``dtype``, with room for block rounding."""
    itemsize = getattr(torch, dtype).itemsize
    per_token = 2 * model_config.num_hidden_layers * model_config.num_key_value_heads * model_config.head_dim
    return max(1, math.ceil(1.25 * tokens * per_token * itemsize / (1 << 30)))


def vllm_env(
    model_config: Any, dtype: str, max_model_len: int, max_num_seqs: int, extra: Sequence[str] = ()
) -> dict[str, str]:
    """The vLLM worker's environment: ours, with the CPU settings that make the comparison even.

    Defaults only where our environment does not set them; ``extra`` (``KEY=VALUE``) always wins. Our
    ``PYTHONPATH`` is dropped: it points at this repository, whose ``kernels`` package would shadow the
    Hugging Face ``kernels`` package that transformers looks for in the worker's environment.

    ``VLLM_ENABLE_V1_MULTIPROCESSING=0``: no process of vLLM's polls its queues beside the model's OpenMP
    threads (on two cores that took a core from them). ``LLM`` then runs its engine core in the calling
    process; the API server keeps the engine core apart but runs the model inside it (two processes, not
    three). Measured here (SmolLM2): ``LLM.generate`` bf16 decode at batch 1/16/64 58/680/1,300 ->
    87/988/1,586 tok/s, start 30 -> 17 s; two API servers started together 60 -> 37 s.
    """
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    cores = cores or list(range(os.cpu_count() or 1))
    defaults = {
        # As many OpenMP threads, on the same cores, as our process computes with; no core kept back for
        # vLLM's scheduler (its "auto" would keep one of two).
        "VLLM_CPU_OMP_THREADS_BIND": cpu_list(cores[: torch.get_num_threads()]),
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib(model_config, dtype, max_model_len * max_num_seqs)),
        "VLLM_LOGGING_LEVEL": "WARNING",
        # vLLM 0.32's AOT-compiled artifacts do not load under torch 2.13 ("'function' object has no
        # attribute 'finalize_loading'"), so each start traced and compiled again (~35 s on 2 cores).
        # Without AOT compile, Dynamo traces again and Inductor's code comes from its cache.
        "VLLM_USE_AOT_COMPILE": "0",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    }
    for key, value in defaults.items():
        env.setdefault(key, value)
    for item in extra:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--vllm-env expects KEY=VALUE, got {item!r}")
        env[key] = value
    return env


def add_vllm_flags(parser: argparse.ArgumentParser) -> None:
    """``--vllm-python`` (default ``$PARROT_VLLM_PYTHON``, which the runner passes through), ``--vllm-dtype``,
    ``--vllm-engine-args`` and ``--vllm-env``: what `benchmarks.harness.vllm_generate.start_vllm` reads."""
    g = parser.add_argument_group("vLLM", "vLLM side by side (needs an interpreter that has vllm)")
    g.add_argument(
        "--vllm-python",
        metavar="PATH",
        default=os.environ.get("PARROT_VLLM_PYTHON") or None,
        help="python of a virtualenv with vLLM installed (default: $PARROT_VLLM_PYTHON)",
    )
    g.add_argument(
        "--vllm-dtype", choices=DTYPES, help="vLLM's dtype (default: bf16 where native, else fp32)"
    )
    g.add_argument(
        "--vllm-engine-args", metavar="JSON", type=_json_object, default={}, help="vllm.LLM kwargs"
    )
    g.add_argument("--vllm-env", metavar="KEY=VALUE", action="append", default=[], help="for the worker only")


def _json_object(text: str) -> dict[str, Any]:
    value = json.loads(text)
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object, e.g. '{\"enforce_eager\": true}'")
    return value
