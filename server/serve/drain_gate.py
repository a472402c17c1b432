"""Whether the server takes new work: closed once a graceful shutdown begins (`Manager.drain`)."""

from __future__ import annotations

from server.serve.errors import ServerDrainingError


class DrainGate:
    """Open until `close`; then every new session, call and OpenAI request is refused (503)."""

    def __init__(self) -> None:
        self.closed = False

    def close(self) -> None:
        self.closed = True

    def check(self, what: str) -> None:
        """Refuse new ``what`` (`ServerDrainingError`) once closed."""
        if self.closed:
            raise ServerDrainingError(
                f"the server is shutting down: it takes no new {what} (what runs finishes); "
                "retry on another server or once it is back"
            )
