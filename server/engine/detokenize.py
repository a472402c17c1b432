"""Incremental detokenization for streaming: text deltas that never need to be taken back."""

from __future__ import annotations

from typing import Any


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    Two things are held back until they are settled: a trailing incomplete UTF-8 sequence (a byte-level
    token can end mid-character, decoding to U+FFFD), and the last ``len(longest stop) - 1`` characters,
    which could still turn out to be the start of a stop string the engine will cut off.
    """

    def __init__(self, tokenizer: Any, stop: list[str] | None = None) -> None:
        self._tokenizer = tokenizer
        self._ids: list[int] = []
        self._sent = 0
        self._holdback = max((len(s) for s in stop or []), default=1) - 1

    def push(self, token_id: int) -> str:
        """Add one token; return the text that is now final."""
        self._ids.append(token_id)
        text = self._tokenizer.decode(self._ids, skip_special_tokens=True)
        end = len(text.rstrip("\ufffd")) - self._holdback
        if end <= self._sent:
            return ""
        delta = text[self._sent : end]
        self._sent = end
        return delta

    def finish(self, final_text: str) -> str:
        """The rest of the final text (the engine's, with any stop string already cut)."""
        return final_text[self._sent :]
