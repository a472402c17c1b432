"""Token ids under the served model's tokenizer, from the server's ``POST /tokenize`` (vLLM's route).

Frameworks count tokens to decide what fits (LangChain's ``get_num_tokens`` and ``trim_messages``,
LlamaIndex's prompt packing). Counting with another tokenizer (tiktoken, GPT-2) gets those decisions wrong
for the model that actually runs, and the client has no copy of the engine's tokenizer; the server does,
and answers ``{"model", "prompt", "add_special_tokens"}`` with ``{"count", "max_model_len", "tokens"}``.

`ServerTokenizer` holds no HTTP client of its own: each adapter passes the ``post`` of the connection it
already has (its retries, timeouts and API key apply), and it remembers recent answers, because those
frameworks count the same texts again and again (``trim_messages`` searches over message prefixes).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from parrot.openai_types import OpenAITokenizeRequest, OpenAITokenizeResponse

__all__ = ["TOKENIZE_PATH", "ServerTokenizer"]

TOKENIZE_PATH = "/tokenize"
"""The route, at the server root (not under ``/v1``, as in vLLM)."""

_CACHE_SIZE = 1024


class ServerTokenizer:
    """``text -> token ids`` of ``model`` (None: the server's default model) through the server.

    ``post(path, body)`` sends one JSON request to the server and returns the decoded JSON answer, raising
    the parrot client's typed errors (a server without the route: `parrot.NotFoundError`). The last
    ``cache_size`` answers are kept.
    """

    def __init__(
        self,
        post: Callable[[str, dict[str, Any]], Any],
        model: str | None = None,
        *,
        cache_size: int = _CACHE_SIZE,
    ) -> None:
        self._post = post
        self.model = model
        self._cache: OrderedDict[tuple[str, bool], list[int]] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """The token ids of ``text``; without special tokens by default (a piece of a prompt, not a whole
        one: the BOS a whole prompt gets is counted once, by whoever renders it)."""
        key = (text, add_special_tokens)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return list(self._cache[key])
        request = OpenAITokenizeRequest(model=self.model, prompt=text, add_special_tokens=add_special_tokens)
        answer = OpenAITokenizeResponse.model_validate(
            self._post(TOKENIZE_PATH, request.model_dump(exclude_none=True))
        )
        with self._lock:
            self._cache[key] = answer.tokens
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return list(answer.tokens)

    def __call__(self, text: str) -> list[int]:
        """`encode` without special tokens: the ``Callable[[str], list[int]]`` frameworks take."""
        return self.encode(text)
