"""Parrot serve: the manager (`server.serve`), the engine (`server.engine`) and the HTTP app
(`server.http.app`).

`server.launch(model="tiny", engines=1, port=0)` starts the whole service in the background
(`server.launcher`).
"""

from __future__ import annotations

import importlib
from typing import Any


def __getattr__(name: str) -> Any:
    # Lazy: `import server.engine` alone must not pull in the web stack.
    if name in ("launch", "LaunchedServer"):
        return getattr(importlib.import_module("server.launcher"), name)
    raise AttributeError(name)
