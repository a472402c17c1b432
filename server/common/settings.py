"""Every ``PARROT_*`` environment variable the service reads, declared once: typed, with its default and
what it does (`kernels.settings.EnvSetting`). ``python -m server --help`` and ``python -m server.engine
--help`` list them; `SETTINGS` is the table. Everything else is configured by flags and config objects.
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from parrot.protocol import API_KEY_ENV

from kernels.settings import KERNEL_SETTINGS, EnvSetting, switch

__all__ = [
    "API_KEY",
    "BACKEND_API_KEY",
    "CACHE_DIR",
    "CLUSTER_TOKEN",
    "PAGED_PREFILL",
    "SETTINGS",
    "cache_dir",
    "epilog",
]


def _text(raw: str) -> str:
    return raw.strip()


def _optional_text(raw: str) -> str | None:
    return raw.strip() or None


def _path(raw: str) -> Path | None:
    return Path(raw.strip()).expanduser()


CLUSTER_TOKEN = EnvSetting(
    "PARROT_CLUSTER_TOKEN",
    "",
    "the cluster token (engines join, operators change the cluster); unset: read from "
    "$PARROT_CACHE_DIR/cluster_token, created there on first start",
    _text,
)
API_KEY = EnvSetting(
    API_KEY_ENV,
    "",
    "the API key clients must send (as --api-key; the client libraries send it too); unset: any key works",
    _text,
)
BACKEND_API_KEY = EnvSetting(
    "PARROT_BACKEND_API_KEY",
    None,
    "the API key sent to OpenAI-compatible backends added with --openai-backend",
    _optional_text,
)
CACHE_DIR = EnvSetting(
    "PARROT_CACHE_DIR",
    None,
    "where the cluster token and converted GGUF tokenizers are kept; unset: ~/.cache/parrot-serve",
    _path,
)
PAGED_PREFILL = EnvSetting(
    "PARROT_PAGED_PREFILL",
    False,
    "on CUDA, fills after cached tokens attend in place over the paged cache (1) instead of gathering it",
    switch,
)
SETTINGS: Sequence[EnvSetting[Any]] = (
    CLUSTER_TOKEN,
    API_KEY,
    BACKEND_API_KEY,
    CACHE_DIR,
    PAGED_PREFILL,
    *KERNEL_SETTINGS,
)


def cache_dir() -> Path:
    """Where converted artifacts and the cluster token are kept: ``$PARROT_CACHE_DIR``, else
    ``~/.cache/parrot-serve``."""
    return CACHE_DIR.get() or Path.home() / ".cache" / "parrot-serve"


def epilog(width: int = 100) -> str:
    """The settings as a command's ``--help`` ends with them (one wrapped paragraph each)."""
    lines = ["environment variables:"]
    for s in SETTINGS:
        text = f"{s.name}: {s.doc}"
        if isinstance(s.default, bool):
            text += f" (default: {int(s.default)})"
        elif s.default:  # None or "": the doc says what happens unset
            text += f" (default: {s.default})"
        lines += textwrap.wrap(text, width, initial_indent="  ", subsequent_indent="    ")
    return "\n".join(lines)
