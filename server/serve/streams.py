"""A step's generated text as it is written, for any number of readers, each from the beginning.

The manager appends token ids as the engine samples them (cheap: no decoding while nobody reads); each
reader decodes with its own `IncrementalDetokenizer`, so it may connect at any time — before the step
starts, while it runs, or after it ended — and still gets the whole text, in deltas that never hold a stop
string. A step that runs again on another engine (its engine failed before it finished) restarts its stream:
readers are told to drop what they had.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Any

from parrot.protocol import GetVariableResponse, VariableStreamEvent

from server.engine.detokenize import IncrementalDetokenizer

__all__ = ["STREAM_ANSWER", "Delta", "Restart", "StepTextStream", "server_sent_events"]

# How the routes that stream a variable describe their answer (OpenAPI).
STREAM_ANSWER = "server-sent events, each a VariableStreamEvent: text deltas, then the final answer"


@dataclass(frozen=True)
class Delta:
    """More of the step's text."""

    text: str


@dataclass(frozen=True)
class Restart:
    """The step runs again from its inputs: the text so far is void."""


class StepTextStream:
    """The tokens of one step's generation (`push`), until it ends (`close`)."""

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.closed = False
        self._tokenizer: Any = None
        self._stop: list[str] = []
        self._final: str | None = None
        self._epoch = 0
        self._changed: asyncio.Event | None = None  # made by a waiting reader: none while nobody reads

    @property
    def started(self) -> bool:
        """Whether a step ever began writing this text."""
        return self._tokenizer is not None

    def start(self, tokenizer: Any, stop: list[str]) -> None:
        """A generation begins (again, after a failed engine: readers restart)."""
        if self.token_ids or self._tokenizer is not None:
            self._epoch += 1
        self.token_ids = []
        self._tokenizer, self._stop, self._final = tokenizer, list(stop), None
        self._wake()

    def push(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        self._wake()

    def finish(self, text: str) -> None:
        """The generation ended with ``text`` (the engine's, stop string cut)."""
        self._final = text
        self._wake()

    def close(self) -> None:
        """No more text will come (the variable settled: done, failed, or never generated)."""
        self.closed = True
        self._wake()

    async def deltas(self) -> AsyncGenerator[Delta | Restart, None]:
        """The text from the beginning, as deltas, until `close`."""
        epoch: int | None = None
        sent, ended, detok = 0, False, None
        while True:
            changed = self._event()  # any change from here on sets it: no wake-up is missed
            if epoch != self._epoch:
                if epoch is not None:
                    yield Restart()
                epoch, sent, ended, detok = self._epoch, 0, False, None
            if detok is None and self._tokenizer is not None:
                detok = IncrementalDetokenizer(self._tokenizer, self._stop)
            if detok is not None and not ended:
                # (checked again after each yield: a restart may come while the reader is away)
                while epoch == self._epoch and sent < len(self.token_ids):
                    sent += 1
                    if text := detok.push(self.token_ids[sent - 1]):
                        yield Delta(text)
                if epoch == self._epoch and self._final is not None and sent == len(self.token_ids):
                    ended = True
                    if rest := detok.finish(self._final):
                        yield Delta(rest)
            if self.closed and epoch == self._epoch:
                return
            await changed.wait()

    def _event(self) -> asyncio.Event:
        if self._changed is None:
            self._changed = asyncio.Event()
        return self._changed

    def _wake(self) -> None:
        # Readers wait on the event of the state they saw; the next reader makes a new one.
        if self._changed is not None:
            self._changed.set()
            self._changed = None


async def server_sent_events(
    items: AsyncIterator[Delta | Restart | GetVariableResponse],
) -> AsyncIterator[str]:
    """A variable's text items (`Manager.variable_text`) as server-sent events, one `VariableStreamEvent`
    each: ``delta``, ``restart``, then ``final``."""
    async for item in items:
        if isinstance(item, Delta):
            event = VariableStreamEvent(delta=item.text)
        elif isinstance(item, Restart):
            event = VariableStreamEvent(restart=True)
        else:
            event = VariableStreamEvent(final=item)
        yield f"data: {event.model_dump_json(exclude_defaults=True)}\n\n"
