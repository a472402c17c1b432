"""Shared fixtures: one embedded server for the whole directory, and a recorder of the prompts it runs.

`PromptRecorder` wraps the engine's ``fill`` and ``submit_generate`` (``generate`` goes through it) and
keeps, for every generation, the token ids of the context it generated from — whichever path reached the
engine (the manager's semantic calls fork contexts; the OpenAI endpoints fill fresh ones). Comparing these
lists between a compiled chain and the same chain run by plain LangChain checks that the engine saw exactly
the same prompts.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from langchain_parrot import TINY_MODEL_DIR, ChatFormat

from server.engine import EngineConfig, LLMEngine
from server.launcher import LaunchedServer, launch


class PromptRecorder:
    """Token ids of every prompt an engine generated from, in order (``prompts``)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.contexts: dict[int, list[int]] = {}
        self.prompts: list[list[int]] = []
        fill, submit = engine.fill, engine.submit_generate

        async def recording_fill(
            context_id: int,
            token_ids: list[int],
            parent_context_id: int | None = None,
            *,
            parent_len: int | None = None,
            **kw: Any,
        ) -> int:
            base = self.contexts.get(parent_context_id, []) if parent_context_id is not None else []
            base = base[:parent_len] if parent_len is not None else base
            self.contexts[context_id] = self.contexts.get(context_id, base) + list(token_ids)
            return await fill(context_id, token_ids, parent_context_id, parent_len=parent_len, **kw)

        def recording_submit(
            context_id: int,
            sampling: Any = None,
            parent_context_id: int | None = None,
            stream: bool = True,
            **kw: Any,
        ) -> Any:
            if context_id not in self.contexts:
                self.contexts[context_id] = list(self.contexts.get(parent_context_id, []))
            self.prompts.append(list(self.contexts[context_id]))
            stream = submit(context_id, sampling, parent_context_id, stream, **kw)
            result, recorded = stream.result, []

            async def recording_result() -> Any:
                done = await result()
                if not recorded:  # (a caller may await the result more than once)
                    recorded.append(True)
                    # The manager keeps the finished context (prompt + output) as a prefix later calls fork.
                    self.contexts[context_id] = self.contexts[context_id] + list(done.token_ids)
                return done

            stream.result = recording_result  # generate() and the manager's token streams both end here
            return stream

        engine.fill = recording_fill  # type: ignore[method-assign]
        engine.submit_generate = recording_submit  # type: ignore[method-assign]

    def mark(self) -> int:
        """A position to read `since` from."""
        return len(self.prompts)

    def since(self, mark: int) -> list[list[int]]:
        return self.prompts[mark:]


@pytest.fixture(scope="session")
def served() -> Iterator[LaunchedServer]:
    """The embedded server (tiny model, one engine), recording its prompts (`recorder`)."""
    with launch("tiny", engine_config=EngineConfig(num_kv_blocks=2048)) as server:
        server.recorder = PromptRecorder(server.engines[0])  # type: ignore[attr-defined]
        yield server


@pytest.fixture(scope="session")
def recorder(served: LaunchedServer) -> PromptRecorder:
    return served.recorder  # type: ignore[attr-defined,no-any-return]


@pytest.fixture(scope="session")
def chat_format() -> ChatFormat:
    """The tiny model's chat template, from its tokenizer folder (the server publishes it too)."""
    return ChatFormat.from_pretrained(TINY_MODEL_DIR)
