"""The Parrot LLM engine: a LLaMA-family model over a paged KV cache with context fork.

```python
engine = LLMEngine.from_pretrained("tiny")
await engine.fill(1, token_ids)
result = await engine.generate(2, SamplingParams(max_tokens=16), parent_context_id=1)
```
"""

try:  # the engine's one hard requirement, checked first for a message that says what to install
    import torch  # noqa: F401
except ModuleNotFoundError as e:
    raise ModuleNotFoundError(
        f"server.engine needs the 'server' extra ({e.name!r} is not installed): "
        "pip install 'parrot-serve[server]'",
        name=e.name,
    ) from e

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
