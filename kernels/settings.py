"""Typed environment settings, and the kernels' own switches.

A setting is declared once (`EnvSetting`: its variable, type, default and doc) and read where it acts with
``.get()``: an unset or empty variable gives the default, a value that does not parse raises `ValueError`
naming the variable and what it takes. Every ``PARROT_*`` variable of the service is listed, with these, in
`server.common.settings.SETTINGS` (``python -m server --help`` prints them).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

__all__ = ["BF16_GEMM", "CPU_KERNELS", "LAYER_KERNELS", "EnvSetting", "choice", "switch"]

T = TypeVar("T")

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def switch(raw: str) -> bool:
    """An on/off value: 1/true/yes/on or 0/false/no/off (any case)."""
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"takes 1 or 0 (true/false, yes/no, on/off), not {raw!r}")


def choice(*options: str) -> Callable[[str], str]:
    """One of ``options`` (any case)."""

    def parse(raw: str) -> str:
        value = raw.strip().lower()
        if value not in options:
            raise ValueError(f"takes one of {', '.join(options)}, not {raw!r}")
        return value

    return parse


@dataclass(frozen=True)
class EnvSetting(Generic[T]):
    """An environment variable the service reads: ``name``, its ``default`` when unset or empty, what it
    does (``doc``) and how its text becomes a value (``parse``)."""

    name: str
    default: T
    doc: str
    parse: Callable[[str], T]

    def get(self) -> T:
        """Its value now (the environment is read on every call: tests and tools may change it)."""
        raw = os.environ.get(self.name, "")
        if not raw.strip():
            return self.default
        try:
            return self.parse(raw)
        except ValueError as e:
            raise ValueError(f"${self.name} {e}") from None


CPU_KERNELS = EnvSetting(
    "PARROT_CPU_KERNELS",
    True,
    "build and use the C++ CPU kernels (kernels.cpu_kernels); 0: never build them, the torch ops run",
    switch,
)
LAYER_KERNELS = EnvSetting(
    "PARROT_LAYER_KERNELS",
    True,
    "fuse the layer ops (norm, rope, SiLU) with Triton on CUDA; 0: the torch ops run",
    switch,
)
BF16_GEMM = EnvSetting(
    "PARROT_BF16_GEMM",
    "auto",
    "which GEMM runs bf16 linears on CPU: auto (the fastest this CPU has), ours or onednn",
    choice("auto", "ours", "onednn"),
)
KERNEL_SETTINGS: Sequence[EnvSetting[Any]] = (CPU_KERNELS, LAYER_KERNELS, BF16_GEMM)
