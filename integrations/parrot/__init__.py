"""Parrot: the Python frontend of Parrot serve (``import parrot as P``).

This package is the light client side (httpx + pydantic only): it never imports the server, torch or
transformers. `parrot.protocol` holds the wire schema shared with the server.

```python
@P.semantic_function(max_tokens=64)
def write_code(task):
    '''Write python code for {{input:task}}. Code: {{output:code}}'''

with P.Session("http://127.0.0.1:9000") as s:
    code = write_code(s.variable("a snake game"))   # a P.Variable (a future): nothing blocks
    print(code.get(criteria=P.LATENCY))
```
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from parrot import transforms
    from parrot.errors import (
        AuthError,
        BadRequestError,
        ConflictError,
        ConnectionError,
        GetTimeoutError,
        NotFoundError,
        ParrotError,
        PayloadTooLargeError,
        ServiceUnavailableError,
        UnprocessableEntityError,
        VariableFailedError,
    )
    from parrot.function import SemanticFunction, semantic_function
    from parrot.protocol import SamplingConfig, TransformSpec
    from parrot.session import Session, current_session
    from parrot.template import TemplateError
    from parrot.variable import LATENCY, THROUGHPUT, Variable

# The API is loaded on first use (PEP 562), so that `import parrot.protocol` (what the server imports)
# stays pydantic-only and does not pull in httpx.
_EXPORTS: dict[str, str] = {
    "transforms": "parrot.transforms",
    **dict.fromkeys(
        [
            "AuthError",
            "BadRequestError",
            "ConflictError",
            "ConnectionError",
            "GetTimeoutError",
            "NotFoundError",
            "ParrotError",
            "PayloadTooLargeError",
            "ServiceUnavailableError",
            "UnprocessableEntityError",
            "VariableFailedError",
        ],
        "parrot.errors",
    ),
    "SemanticFunction": "parrot.function",
    "semantic_function": "parrot.function",
    "SamplingConfig": "parrot.protocol",
    "TemplateError": "parrot.protocol",
    "TransformSpec": "parrot.protocol",
    "Session": "parrot.session",
    "current_session": "parrot.session",
    "LATENCY": "parrot.variable",
    "THROUGHPUT": "parrot.variable",
    "Variable": "parrot.variable",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'parrot' has no attribute {name!r}")
    value = (
        importlib.import_module(module)
        if name == "transforms"
        else getattr(importlib.import_module(module), name)
    )
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


__version__ = "0.1.0"

__all__ = [
    "LATENCY",
    "THROUGHPUT",
    "AuthError",
    "BadRequestError",
    "ConflictError",
    "ConnectionError",
    "GetTimeoutError",
    "NotFoundError",
    "ParrotError",
    "PayloadTooLargeError",
    "SamplingConfig",
    "SemanticFunction",
    "ServiceUnavailableError",
    "Session",
    "TemplateError",
    "TransformSpec",
    "UnprocessableEntityError",
    "Variable",
    "VariableFailedError",
    "current_session",
    "semantic_function",
    "transforms",
]
