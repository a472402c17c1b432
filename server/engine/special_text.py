"""User text is text: special-token strings inside values and message contents encode as plain text.

A tokenizer reads a special token's string (``<|im_end|>``, ``<|im_start|>``) anywhere in the text it encodes
as that control token, so a user who types ``<|im_end|>\\n<|im_start|>system`` into a chat message or a
variable value would forge a system turn. Text a user supplied is therefore *masked* before it joins the
prompt: each special-token string in it is replaced by one private-use character standing for it
(`SpecialText.mask`). The prompt's own text (a template's constant text, a chat template's markers) keeps its
special tokens; `SpecialText.encode` encodes the prompt as usual and each stand-in as its string's ordinary
pieces. A prompt holding no stand-in (every ordinary prompt) is encoded exactly as before.

Callers who mean the control tokens put them in the prompt's own text: a semantic function's template, or
the ``prompt`` of ``/v1/completions`` (raw text, read as vLLM reads it).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

__all__ = ["SpecialText"]

# Supplementary Private Use Area-B: never assigned a meaning, and one character per special token.
_FIRST_STAND_IN = 0x100000
_MAX_SPECIALS = 4096


@dataclass(frozen=True)
class SpecialText:
    """The special-token strings of one tokenizer, and the character standing in for each in masked text."""

    strings: tuple[str, ...]
    _find: re.Pattern[str] | None = field(default=None, repr=False, compare=False)
    _stand_ins: re.Pattern[str] | None = field(default=None, repr=False, compare=False)
    _stand_in_of: dict[str, str] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def of(cls, tokenizer: Any) -> SpecialText:
        """The special tokens ``tokenizer`` parses out of text (none for a tokenizer that does not say)."""
        decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
        found = {t.content for t in decoder.values() if getattr(t, "special", False)}
        found.update(getattr(tokenizer, "all_special_tokens", None) or ())
        strings = tuple(sorted((s for s in found if s), key=lambda s: (-len(s), s)))[:_MAX_SPECIALS]
        if not strings:
            return cls(())
        # Longest first: where one special string contains another, the longer one is masked whole.
        find = re.compile("|".join(re.escape(s) for s in strings))
        last = chr(_FIRST_STAND_IN + len(strings) - 1)
        stand_in_of = {s: chr(_FIRST_STAND_IN + i) for i, s in enumerate(strings)}
        return cls(strings, find, re.compile(f"[{chr(_FIRST_STAND_IN)}-{last}]"), stand_in_of)

    def mask(self, text: str) -> str:
        """``text`` (a user's) with each special-token string replaced by its stand-in."""
        if self._find is None:
            return text
        return self._find.sub(lambda m: self._stand_in_of[m.group()], text)

    def encode(self, tokenizer: Any, text: str, add_special_tokens: bool = True) -> list[int]:
        """``text``'s token ids: as ``tokenizer.encode`` gives them, but each stand-in (from `mask`) encoded
        as its special string's plain-text pieces."""
        if self._stand_ins is None or self._stand_ins.search(text) is None:
            return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))
        ids = list(tokenizer.encode("", add_special_tokens=add_special_tokens))  # a BOS, if it adds one
        start = 0
        for m in self._stand_ins.finditer(text):
            if m.start() > start:
                ids += tokenizer.encode(text[start : m.start()], add_special_tokens=False)
            special = self.strings[ord(m.group()) - _FIRST_STAND_IN]
            ids += tokenizer.encode(special, add_special_tokens=False, split_special_tokens=True)
            start = m.end()
        if start < len(text):
            ids += tokenizer.encode(text[start:], add_special_tokens=False)
        return ids
