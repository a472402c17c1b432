"""Typed exceptions (and the one warning) of the LangChain integration.

Errors about the service itself (server down, timeouts, HTTP status codes, failed variables) are the
`parrot` client's own typed errors (`parrot.errors`), raised unchanged or with the URL and the number of
attempts added; the classes here are about what a LangChain chain asks for that cannot be done — and
`ServerParserError`, an output parser failing server-side, which must be LangChain's
``OutputParserException`` for LangChain's retry and fallback machinery to recognise it.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable

from langchain_core.exceptions import OutputParserException
from parrot.errors import VariableFailedError
from parrot.protocol import TRANSFORM_FAILED

__all__ = [
    "ClientSideStepWarning",
    "CompileError",
    "MissingVariableError",
    "ParrotLangChainError",
    "ServerParserError",
    "UnsupportedInputError",
    "UnsupportedParserError",
    "server_parser_error",
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


class ServerParserError(OutputParserException, VariableFailedError):
    """An output parser of a compiled chain failed on the server (its transform refused the model's text).

    LangChain's `OutputParserException` — what the same parser raises in the uncompiled chain, so
    ``with_retry(retry_if_exception_type=(OutputParserException,))``, ``with_fallbacks`` and agents'
    parsing-error handling apply — and still the `parrot.VariableFailedError` of the failed variable
    (``var_id``, the server's ``reason`` and ``error_type``). ``llm_output`` is the text the parser
    refused, whole, as the server sends it (the variable's ``llm_output``); ``transform`` the server-side
    transform (``"json"``, ``"xml"``, ``"regex"``...). ``llm_output_complete`` is False only when the server
    did not send the text — one over its bound (64 Ki characters), or a server older than the field — and
    ``llm_output`` is then the start its message quotes (200 characters).
    """

    default_type = "output_parser"

    def __init__(
        self,
        failure: VariableFailedError,
        *,
        transform: str,
        llm_output: str,
        llm_output_complete: bool,
    ) -> None:
        VariableFailedError.__init__(
            self,
            failure.message,
            var_id=failure.var_id,
            reason=failure.reason,
            error_type=failure.error_type,
            llm_output=llm_output,
        )
        note = "" if llm_output_complete else " (llm_output holds only the start the server quoted)"
        # Last, so that str() and args are LangChain's form of the message (with its troubleshooting link).
        OutputParserException.__init__(self, failure.message + note, llm_output=llm_output)
        self.transform = transform
        self.llm_output_complete = llm_output_complete


# "<type> transform failed: <why>": how the server's transforms (server/serve/transforms.py) begin their
# messages, which name the transform. When the server does not send the refused text (one over its bound, or
# an older server), a parser's refusal ends "in|on|does not match <repr of the text>[... (<n> chars)]",
# quoting the text with repr() cut after 200 characters; key-path lookups and limits end otherwise: not parse
# failures of the model's text, they stay `VariableFailedError`s.
_TRANSFORM_FAILED = re.compile(r"(?P<transform>\w+) transform failed: ")
_QUOTED_TEXT = re.compile(
    r"(?: in | on | does not match )"
    r"(?P<text>'(?:[^'\\\n]|\\.)*'|\"(?:[^\"\\\n]|\\.)*\")"
    r"(?P<cut>\.\.\. \(\d+ chars\))?$"
)


def server_parser_error(failure: VariableFailedError) -> ServerParserError | None:
    """The `ServerParserError` for ``failure`` when it is (or comes from, upstream) a server-side parser
    refusing a model's text; None for any other failure.

    The server sends the refused text as data (``failure.llm_output``, for the failed output and everything
    downstream of it). Without it, the text is read back from the start the message quotes."""
    if failure.error_type is not None and failure.error_type != TRANSFORM_FAILED:
        return None  # the server says what failed, and it was not a transform
    reason = failure.reason or ""
    found = _TRANSFORM_FAILED.search(reason)
    if found is None:
        return None
    if failure.llm_output is not None:
        return ServerParserError(
            failure, transform=found["transform"], llm_output=failure.llm_output, llm_output_complete=True
        )
    # The quote runs to the end of the message, so the first match is it (a quote in the explanation
    # before it cannot span to the end); literal_eval turns repr()'s escapes back into the text.
    quoted = _QUOTED_TEXT.search(reason, found.end())
    if quoted is None:
        return None
    try:
        text = ast.literal_eval(quoted["text"])
    except (ValueError, SyntaxError):
        return None
    return ServerParserError(
        failure, transform=found["transform"], llm_output=str(text), llm_output_complete=quoted["cut"] is None
    )
