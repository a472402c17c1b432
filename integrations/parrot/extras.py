"""What a package of this distribution needs from an optional extra, checked at its import with a message
that names the ``pip install`` to run (rather than a bare ModuleNotFoundError deep in a traceback)."""

from __future__ import annotations

import importlib

__all__ = ["require_extra"]


def require_extra(module: str, needed_by: str, extra: str) -> None:
    """Import ``module``, or raise `ModuleNotFoundError` saying that ``needed_by`` needs the ``extra``."""
    try:
        importlib.import_module(module)
    except ModuleNotFoundError as missing:
        raise ModuleNotFoundError(
            f"{needed_by} needs the {extra!r} extra ({missing.name!r} is not installed): "
            f"pip install 'parrot-serve[{extra}]'",
            name=missing.name,
        ) from None
