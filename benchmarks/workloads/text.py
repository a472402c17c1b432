"""Workload text the application benchmarks share: a long document cut into parts of a given number of
tokens (`document_chunks`, from `workload_text.stdlib_text`) and the prompt a request-centric client
renders from a Parrot template (`render_template`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from workload_text import stdlib_text


def document_chunks(tokenizer: Any, count: int, chunk_tokens: int) -> list[str]:
    """``count`` consecutive pieces of `stdlib_text`, ``chunk_tokens`` tokens each under ``tokenizer`` (a
    Hugging Face tokenizer), decoded back to text: a long document cut into parts."""
    need = count * chunk_tokens
    chars = 4 * need
    while True:
        ids = tokenizer(stdlib_text(chars), add_special_tokens=False).input_ids
        if len(ids) >= need:
            break
        chars *= 2
    return [tokenizer.decode(ids[i * chunk_tokens : (i + 1) * chunk_tokens]) for i in range(count)]


def render_template(template: str, values: Mapping[str, str]) -> str:
    """A request-centric client's rendering of a Parrot template: constant text with the input values in,
    cut at the first output placeholder — exactly the prompt the Parrot server renders for that step."""
    from parrot.template import TemplatePlaceholder, TemplateText, parse_template

    parts: list[str] = []
    for piece in parse_template(template):
        if isinstance(piece, TemplateText):
            parts.append(piece.text)
        elif isinstance(piece, TemplatePlaceholder) and piece.role == "input":
            parts.append(values[piece.name])
        else:
            break
    return "".join(parts)
