"""Typed errors of the LlamaIndex adapter: each says what is wrong and what to change.

Errors of the service itself (unreachable server, rejected template, failed variable) are the parrot
client's own (`parrot.ParrotError` and subclasses, e.g. `parrot.ConnectionError` naming the URL); the ones
here are about what LlamaIndex handed the adapter.
"""

from __future__ import annotations

__all__ = [
    "EmptyNodesError",
    "MissingTemplateVariableError",
    "ParrotLlamaIndexError",
    "PromptConversionError",
    "UnsupportedSynthesisError",
]


class ParrotLlamaIndexError(Exception):
    """Base of the adapter's own errors."""


class MissingTemplateVariableError(ParrotLlamaIndexError, KeyError):
    """A prompt template variable has no value (LlamaIndex would silently send ``{name}`` to the model).

    ``missing`` lists the variable names, ``template`` is the template text.
    """

    def __init__(self, missing: list[str], template: str, given: list[str]) -> None:
        self.missing = missing
        self.template = template
        names = ", ".join(repr(m) for m in missing)
        have = ", ".join(repr(g) for g in given) or "none"
        shown = template if len(template) <= 160 else template[:157] + "..."
        super().__init__(
            f"the prompt template needs {names} but no value was given for it (given: {have}); pass it as "
            f"a keyword argument or with prompt.partial_format(...). Template: {shown!r}"
        )

    def __str__(self) -> str:  # KeyError would show the repr of the message
        return str(self.args[0])


class PromptConversionError(ParrotLlamaIndexError, ValueError):
    """LlamaIndex's rendering of a prompt is not a plain substitution of its variables.

    Raised when a value must stay a server-side variable (a synthesizer's intermediate answer) but the
    prompt transforms values before inserting them (a ``function_mappings`` entry that computes from them,
    or a ``completion_to_prompt`` that rewrites the text around them), so the prompt cannot be sent
    unrendered.
    """


class EmptyNodesError(ParrotLlamaIndexError, ValueError):
    """A synthesizer was given no nodes (or only empty text) to answer from."""


class UnsupportedSynthesisError(ParrotLlamaIndexError, ValueError):
    """A synthesizer option whose control flow depends on client-side code between the LLM calls."""
