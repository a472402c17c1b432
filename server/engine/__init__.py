"""The Parrot LLM engine: a LLaMA-family model over a paged KV cache with context fork.

```python
engine = LLMEngine.from_pretrained("tiny")
await engine.fill(1, token_ids)
result = await engine.generate(2, SamplingParams(max_tokens=16), parent_context_id=1)
```

The names below load on first use: importing the package (or a light module of it, as the command lines'
parsers do) does not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from server.engine.config import EngineConfig, ModelConfig
    from server.engine.engine import EngineStats, LLMEngine
    from server.engine.engine_front import GenerationStream
    from server.engine.errors import (
        ContextBusyError,
        ContextExistsError,
        EngineDeadError,
        EngineError,
        InvalidRequestError,
        InvalidSamplingParamsError,
        PromptTooLongError,
        RequestAbortedError,
        TokenOutOfVocabError,
        UnknownContextError,
    )
    from server.engine.request import GenerateResult
    from server.engine.sampling import SamplingParams

_ERRORS = "server.engine.errors"
_HOMES = {
    "ContextBusyError": _ERRORS,
    "ContextExistsError": _ERRORS,
    "EngineConfig": "server.engine.config",
    "EngineDeadError": _ERRORS,
    "EngineError": _ERRORS,
    "EngineStats": "server.engine.wire",
    "GenerateResult": "server.engine.request",
    "GenerationStream": "server.engine.engine_front",
    "InvalidRequestError": _ERRORS,
    "InvalidSamplingParamsError": _ERRORS,
    "LLMEngine": "server.engine.engine",
    "ModelConfig": "server.engine.config",
    "PromptTooLongError": _ERRORS,
    "RequestAbortedError": _ERRORS,
    "SamplingParams": "server.engine.sampling",
    "TokenOutOfVocabError": _ERRORS,
    "UnknownContextError": _ERRORS,
}

__all__ = [
    "ContextBusyError",
    "ContextExistsError",
    "EngineConfig",
    "EngineDeadError",
    "EngineError",
    "EngineStats",
    "GenerateResult",
    "GenerationStream",
    "InvalidRequestError",
    "InvalidSamplingParamsError",
    "LLMEngine",
    "ModelConfig",
    "PromptTooLongError",
    "RequestAbortedError",
    "SamplingParams",
    "TokenOutOfVocabError",
    "UnknownContextError",
]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'server.engine' has no attribute {name!r}")
    try:
        value = getattr(importlib.import_module(home), name)
    except ModuleNotFoundError as e:
        if e.name != "torch":
            raise
        # the engine's one hard requirement: a message that says what to install
        raise ModuleNotFoundError(
            f"server.engine needs the 'server' extra ({e.name!r} is not installed): "
            "pip install 'parrot-serve[server]'",
            name=e.name,
        ) from e
    globals()[name] = value
    return value
