"""Incremental detokenization for streaming: text deltas that never need to be taken back."""

from __future__ import annotations

from typing import Any


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas that never contain (any part of) a stop string.

    Held back until settled: a trailing incomplete UTF-8 sequence (a byte-level token can end mid-character,
    decoding to U+FFFD) and the last ``len(longest stop) - 1`` characters, which could still become the
    start of a stop string. And since one token can bring a whole stop string (and more) at once, the decoded
    text is searched for the stop strings: nothing from the first one on is ever sent.
    """

    def __init__(self, tokenizer: Any, stop: list[str] | None = None) -> None:
        self._tokenizer = tokenizer
        self._stop = list(stop or [])
        self._longest = max((len(s) for s in self._stop), default=0)
        self._holdback = max(self._longest - 1, 0)
        self._ids: list[int] = []
        self._sent = 0
        self._stopped = False

    def push(self, token_id: int) -> str:
        """Add one token; return the text that is now final."""
        if self._stopped:
            return ""
        self._ids.append(token_id)
        text = self._tokenizer.decode(self._ids, skip_special_tokens=True)
        start = max(0, self._sent - self._longest)  # a stop string cannot start inside what was sent
        cuts = [i for i in (text.find(s, start) for s in self._stop) if i >= 0]
        if cuts:
            self._stopped = True
            end = min(cuts)
        else:
            end = len(text.rstrip("\ufffd")) - self._holdback
        if end <= self._sent:
            return ""
        delta = text[self._sent : end]
        self._sent = end
        return delta

    def finish(self, final_text: str) -> str:
        """The rest of the final text (the engine's, with any stop string already cut)."""
        return final_text[self._sent :]
