"""How costly a regex constraint is to enforce, read from its text before anything compiles it.

A bounded repetition is expanded into a grammar, and bounded repetitions nested in one another multiply:
``(([a-z0-9]{1,50}){1,50}){1,20}`` is 33 characters and 50 x 50 x 20 = 50,000 expanded copies, ambiguous
enough that the matcher's state grows with every token (measured: a token's mask took over a second within
30 tokens). `repetition_product` is the largest product of bounded repetition counts along any nesting path;
the engine refuses a pattern above `MAX_REPETITION_PRODUCT` (`GuidedDecoding.validate`). Unbounded loops
(``*``, ``+``, ``{m,}``) are not expanded and count as 1.
"""

from __future__ import annotations

import re

__all__ = ["MAX_REPETITION_PRODUCT", "repetition_product"]

MAX_REPETITION_PRODUCT = 2_000
_COUNT = re.compile(r"\{(\d*)(,?)(\d*)\}")


def repetition_product(pattern: str) -> int:
    """The largest product of nested bounded repetition counts in ``pattern`` (1: none). Linear in its
    length; an unbalanced pattern is measured as far as it goes (the compiler refuses it after)."""
    # Per open group: the largest product inside it so far, and the product of the atom last closed
    # (which a following quantifier multiplies).
    inside: list[int] = [1]
    last = 1
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        if c == "\\":
            last, i = 1, i + 2
            continue
        if c == "[":
            i = _class_end(pattern, i)
            last = 1
            continue
        if c == "(":
            inside.append(1)
            i += 1
            continue
        if c == ")" and len(inside) > 1:
            last = inside.pop()
            inside[-1] = max(inside[-1], last)
            i += 1
            continue
        if c == "{":
            m = _COUNT.match(pattern, i)
            if m is not None:
                low, comma, high = m.groups()
                count = int(high) if high else (1 if comma else int(low or 1))
                last *= max(count, 1)
                inside[-1] = max(inside[-1], last)
                i = m.end()
                continue
        if c not in "*+?":  # an unbounded or optional quantifier keeps its atom's count; others start anew
            last = 1
        inside[-1] = max(inside[-1], last)
        i += 1
    return max(inside)


def _class_end(pattern: str, start: int) -> int:
    """The index after the character class opening at ``start`` (``]`` first in it is literal)."""
    i = start + 1
    if i < len(pattern) and pattern[i] == "^":
        i += 1
    if i < len(pattern) and pattern[i] == "]":
        i += 1
    while i < len(pattern) and pattern[i] != "]":
        i += 2 if pattern[i] == "\\" else 1
    return i + 1
