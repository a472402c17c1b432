"""Typed exceptions (and the one warning) of the LangChain integration.

Errors about the service itself (server down, timeouts, HTTP status codes, failed variables) are the
`parrot` client's own typed errors (`parrot.errors`), raised unchanged or with the URL and the number of
attempts added; the classes here are about what a LangChain chain asks for that cannot be done.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = [
    "ClientSideStepWarning",
    "CompileError",
    "MissingVariableError",
    "ParrotLangChainError",
    "UnsupportedInputError",
    "UnsupportedParserError",
]


class ParrotLangChainError(Exception):
    """Base of the errors `langchain_parrot` raises about a chain or its input."""


class CompileError(ParrotLangChainError, ValueError):
    """`compile_chain` cannot compile this runnable as given (the message says what to change)."""


class UnsupportedParserError(CompileError, TypeError):
    """An output parser with no server-side transform (a custom or subclassed parser)."""


class UnsupportedInputError(ParrotLangChainError, ValueError):
    """A model input the Parrot server cannot take (images, tool calls, unknown message roles...)."""


class MissingVariableError(ParrotLangChainError, KeyError):
    """A prompt template's variable is missing from the input it was given.

    A `KeyError`, as LangChain raises for the same mistake, with a readable message: ``variables`` are the
    missing names, ``received`` the keys that were given.
    """

    def __init__(self, prompt: str, variables: Iterable[str], received: Iterable[str]) -> None:
        self.variables = sorted(variables)
        self.received = sorted(received)
        got = ", ".join(map(repr, self.received)) or "none"
        self.message = (
            f"{prompt} is missing variable(s) {', '.join(map(repr, self.variables))} (received: {got}); "
            "pass them in the input (or as partial variables), or escape a literal brace as '{{' in an "
            "f-string template"
        )
        super().__init__(self.message)

    def __str__(self) -> str:  # KeyError's str() is the repr of its argument: keep the message readable
        return self.message


class ClientSideStepWarning(UserWarning):
    """Part of a compiled chain runs on the client (named in the message): values it needs from earlier
    model steps are fetched first, a client round trip the rest of the chain does not pay."""
