"""Console-script entry points that must answer before the engine package is imported.

``parrot-engine`` runs `server.engine.__main__.main`, but importing anything under `server.engine` first
imports torch (the package's ``__init__``); on an install without the ``server`` extra that is a bare
``ModuleNotFoundError``. This wrapper turns it into one line naming the ``pip install`` to run.
(``parrot-serve`` needs no wrapper: `server.__main__` guards its own imports.)
"""

from __future__ import annotations

from server.cli import exit_if_extra_missing


def parrot_engine() -> int:
    """``parrot-engine``: the same as ``python -m server.engine``."""
    try:
        from server.engine.__main__ import main
    except ModuleNotFoundError as missing:
        exit_if_extra_missing(missing, "parrot-engine")
        raise
    return main()
