"""The command-line flags the benchmarks share and what they resolve to: the size flags (``--quick``,
``--tiny``, ``--json``) and the configuration they pick (`sized`), the engine flags (``--model``,
``--threads``) applied by `set_threads`, the dtype a benchmark times in (`bench_dtype`) and a
comma-separated sweep (`int_list`)."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any, TypeVar

Config = TypeVar("Config")


def add_size_flags(parser: argparse.ArgumentParser, quick_help: str) -> None:
    """The flags every benchmark takes: ``--quick`` (about a minute on 2 cores), ``--tiny`` (a harness
    check in seconds) and ``--json PATH``."""
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help=quick_help)
    size.add_argument(
        "--tiny",
        action="store_true",
        help="the smallest configuration running every code path (a harness check: figures mean nothing)",
    )
    parser.add_argument("--json", metavar="PATH", help="write the figures and machine info as JSON")


def add_engine_flags(parser: argparse.ArgumentParser, model: bool = True) -> None:
    """The flags of scripts that run the real engine: ``--model`` (with ``model``) and ``--threads``
    (applied by `set_threads`)."""
    if model:
        parser.add_argument(
            "--model",
            default="tiny",
            help='"tiny" (default), "smollm2", a .gguf file or a local Hugging Face folder',
        )
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")


def set_threads(args: argparse.Namespace) -> None:
    """Apply ``--threads`` (`add_engine_flags`) to torch, if given."""
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)


def int_list(text: str) -> tuple[int, ...]:
    """An argparse type: ``"16,32,64"`` -> ``(16, 32, 64)``, each at least 1; ``""`` is an empty sweep."""
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def sized(args: argparse.Namespace, full: Config, quick: Config, tiny: Config, **overrides: Any) -> Config:
    """The configuration ``args`` asks for (`add_size_flags`), with every override that is not None."""
    cfg = tiny if args.tiny else quick if args.quick else full
    return dataclasses.replace(cfg, **{k: v for k, v in overrides.items() if v is not None})  # type: ignore[type-var]


def bench_dtype(device: Any, name: str | None = None) -> str:
    """The dtype a benchmark times in: ``name`` if given, else bfloat16 on CUDA and float32 on CPU."""
    return name or ("bfloat16" if getattr(device, "type", device) == "cuda" else "float32")
