"""Reading a variable's text as the server writes it (``GET .../variables/{var_id}/stream``).

Pure pieces, shared by the sync and async sessions: the server-sent events parsed (`stream_events`), and a
`TextFollower` that turns them into the text to show. The server replays a step's text from the beginning on
every connection, and restarts it when the step runs again on another engine; the follower yields each
character once, across reconnections and restarts, as long as the text repeats what was already shown (a
greedy or seeded step writes the same text again), and raises `StreamRestartedError` when it does not.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from parrot.errors import ParrotError
from parrot.protocol import GetVariableResponse, VariableStreamEvent

__all__ = ["StreamRestartedError", "TextFollower", "stream_events"]


class StreamRestartedError(ParrotError):
    """The producing step ran again (its engine failed) and wrote a text other than the one streamed so far:
    what was shown is void; ``get()`` the variable for its value."""

    default_type = "stream_restarted"


def stream_events(lines: Iterable[str]) -> Iterator[VariableStreamEvent]:
    """The events of a server-sent event body, given its lines."""
    for line in lines:
        if line.startswith("data: "):
            yield VariableStreamEvent.model_validate_json(line[6:])


class TextFollower:
    """Text to show from a variable's stream events; `final` once the server sent the variable's answer."""

    def __init__(self, label: str) -> None:
        self._label = label
        self._shown = ""  # what the caller has been given
        self._replayed = ""  # the text of the current run, as far as it came
        self.final: GetVariableResponse | None = None

    def reconnect(self) -> None:
        """A new connection: the server replays the text from its beginning."""
        self._replayed = ""
        self.final = None

    def feed(self, event: VariableStreamEvent) -> str:
        """The part of ``event`` not shown yet (empty while a replay catches up)."""
        if event.final is not None:
            self.final = event.final
            return ""
        if event.restart:
            self.reconnect()
            return ""
        if not event.delta:
            return ""
        self._replayed += event.delta
        if len(self._replayed) <= len(self._shown):
            if not self._shown.startswith(self._replayed):
                raise self._diverged()
            return ""
        if not self._replayed.startswith(self._shown):
            raise self._diverged()
        new = self._replayed[len(self._shown) :]
        self._shown = self._replayed
        return new

    def _diverged(self) -> StreamRestartedError:
        return StreamRestartedError(
            f"{self._label}: its step ran again on another engine and wrote a different text than the one "
            "streamed so far; get() the variable for its value"
        )
