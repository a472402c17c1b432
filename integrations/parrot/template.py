"""The template grammar of a semantic function's prompt: constant text plus ``{{input:x}}`` and
``{{output:y}}`` placeholders, parsed strictly (`parse_template`), with errors that name the line and column.

Pure Python: the client checks a template before sending it, and the server parses it the same way.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal

# A semantic function's prompt is sent unrendered: constant text plus placeholders.
#
#   placeholder  :=  "{{" ws role ws ":" ws name ws "}}"     ws: spaces or tabs only, any amount
#   role         :=  "input" | "output"
#   name         :=  a Python identifier (str.isidentifier)
#
# Literal braces: "{{{{" is a literal "{{" — the one escape (`escape_text` applies it) — and any other "{{"
# opens a placeholder. Read left to right, a run of "{" is: "{{{{" -> literal "{{"; else "{{{" -> a literal
# "{" (the next two may open a placeholder); else "{{" -> a placeholder; else a lone, literal "{". So
# "{{{input:x}}}" is "{", the placeholder, "}"; and "{{{{{{input:x}}" is "{{" and the placeholder.
# Every "}" outside a placeholder ("}}" included) is plain text and needs no escape: JSON and code in
# prompts close "}}" all the time, and outside a placeholder "}}" cannot be mistaken for anything.
# Strict on purpose: a typo such as "{{inptu:x}}" is an error, never silently sent to the model as text.
#
# Rules beyond the grammar, each a `TemplateError` naming what to fix and where:
#   * at least one output (a call exists to produce something);
#   * two outputs need constant text between them: generation of the first needs a boundary before the
#     second begins (the text after an output is what separates it from the next);
#   * an output name appears once (an output is produced once); an input may appear any number of times;
#   * a name is either an input or an output, never both.

Role = Literal["input", "output"]
# The most placeholders one template may hold (each one is a boundary the server tracks and renders).
MAX_TEMPLATE_PLACEHOLDERS = 4096
ROLES: tuple[Role, ...] = ("input", "output")
_HSPACE = " \t"


@dataclass(frozen=True)
class TemplateText:
    """Constant text of a template (escapes already undone: ``text`` is what the model sees).

    ``start``/``end`` locate the piece in the template source; they are not part of equality.
    """

    text: str
    start: int = field(default=0, compare=False)
    end: int = field(default=0, compare=False)


@dataclass(frozen=True)
class TemplatePlaceholder:
    """A ``{{role:name}}`` placeholder; ``start``/``end`` locate it in the source (not part of equality)."""

    role: Role
    name: str
    start: int = field(default=0, compare=False)
    end: int = field(default=0, compare=False)


TemplatePiece = TemplateText | TemplatePlaceholder


def _line_col(text: str, offset: int) -> tuple[int, int]:
    """1-based line and column of a character offset."""
    line_start = text.rfind("\n", 0, offset) + 1
    return text.count("\n", 0, offset) + 1, offset - line_start + 1


def _snippet(text: str, limit: int = 40) -> str:
    return repr(text if len(text) <= limit else text[: limit - 3] + "...")


class TemplateError(ValueError):
    """A template that does not follow the grammar (HTTP 400 on the server).

    ``reason`` says what is wrong and how to fix it; ``offset`` (a character offset into the template),
    ``line`` and ``column`` (1-based) say where, or are None for a whole-template problem.
    """

    def __init__(self, reason: str, template: str | None = None, offset: int | None = None) -> None:
        self.reason = reason
        self.offset = offset
        self.line: int | None = None
        self.column: int | None = None
        where = "template"
        if template is not None and offset is not None:
            self.line, self.column = _line_col(template, offset)
            where = f"template, line {self.line}, column {self.column} (offset {offset})"
        super().__init__(f"{where}: {reason}")


def _parse_placeholder(template: str, start: int) -> TemplatePlaceholder:
    """Parse the placeholder whose ``{{`` is at ``start``."""
    close = template.find("}}", start + 2)
    # A placeholder never spans lines or contains another "{{": stopping there points at the real culprit
    # (the unclosed "{{") instead of some "}}" much later in the template. Both searches end at ``close``,
    # so parsing stays linear in the template's length however many placeholders it has.
    newline = template.find("\n", start + 2, max(close, 0))
    reopen = template.find("{{", start + 2, max(close, 0))
    if close < 0 or newline >= 0 or reopen >= 0:
        raise TemplateError(
            f"unclosed '{{{{' ({_snippet(template[start : start + 30])}): close the placeholder with '}}}}' "
            "on the same line, or write '{{{{' for a literal '{{'",
            template,
            start,
        )
    end = close + 2
    source = template[start:end]
    body = template[start + 2 : close]
    if ":" not in body:
        word = body.strip(_HSPACE)
        hint = (
            f"write {{{{input:{word}}}}} or {{{{output:{word}}}}}"
            if word.isidentifier()
            else "placeholders are {{input:NAME}} or {{output:NAME}}"
        )
        raise TemplateError(f"placeholder {source!r} has no role: {hint}", template, start)
    role, _, name = (part.strip(_HSPACE) for part in body.partition(":"))
    if role not in ROLES:
        close_matches = difflib.get_close_matches(role, ROLES, n=1)
        hint = f" (did you mean {close_matches[0]!r}?)" if close_matches else ""
        raise TemplateError(
            f"unknown role {role!r} in {source!r}: the role is 'input' or 'output'{hint}", template, start
        )
    if not name:
        raise TemplateError(
            f"placeholder {source!r} has an empty name: write {{{{{role}:NAME}}}}", template, start
        )
    if not name.isidentifier():
        raise TemplateError(
            f"placeholder name {name!r} in {source!r} is not a Python identifier "
            "(letters, digits and underscores, not starting with a digit)",
            template,
            start,
        )
    checked: Role = "input" if role == "input" else "output"  # narrows the str for type checkers
    return TemplatePlaceholder(checked, name, start, end)


def _scan(template: str) -> Iterator[TemplatePiece]:
    """Split a template into pieces by the grammar alone, lazily (so errors come in text order)."""
    chunks: list[str] = []  # literal text since the last placeholder
    text_start = 0
    i = 0
    n = len(template)
    while i < n:
        j = template.find("{", i)
        if j < 0:
            chunks.append(template[i:])
            break
        chunks.append(template[i:j])
        if template.startswith("{{{{", j):
            chunks.append("{{")
            i = j + 4
        elif template.startswith("{{{", j) or not template.startswith("{{", j):
            chunks.append("{")  # a lone "{", or a "{" before the last two of a run
            i = j + 1
        else:
            if text := "".join(chunks):
                yield TemplateText(text, text_start, j)
            chunks = []
            placeholder = _parse_placeholder(template, j)
            yield placeholder
            i = text_start = placeholder.end
    if text := "".join(chunks):
        yield TemplateText(text, text_start, n)


def _check_placeholder(
    template: str, piece: TemplatePlaceholder, first: TemplatePlaceholder, previous: TemplatePiece | None
) -> None:
    """The rules between placeholders, for ``piece`` given its name's first use and the piece before it."""

    def where() -> str:  # only when refusing: finding a line is linear in the template
        return "line {}, column {}".format(*_line_col(template, first.start))

    if first is not piece and first.role != piece.role:
        raise TemplateError(
            f"{piece.name!r} is used as both {first.role} (at {where()}) and {piece.role}: "
            "a name is either an input or an output; rename one",
            template,
            piece.start,
        )
    if first is not piece and piece.role == "output":
        raise TemplateError(
            f"output {piece.name!r} appears twice (first at {where()}): an output is produced once; "
            "rename one, or read it as an {{input:...}} in a following call",
            template,
            piece.start,
        )
    if piece.role == "output" and isinstance(previous, TemplatePlaceholder) and previous.role == "output":
        raise TemplateError(
            f"outputs {previous.name!r} and {piece.name!r} are adjacent: put constant text between "
            f"them so that {previous.name!r} has a boundary where it ends",
            template,
            piece.start,
        )


def parse_template(template: str) -> list[TemplatePiece]:
    """Parse a semantic function's template into constant text and placeholders, in order.

    Adjacent text is merged (two `TemplateText` are never neighbours); placeholders may be. Raises
    `TemplateError` (with the line and column) for a malformed placeholder, adjacent outputs, an output
    used twice, a name used as both input and output, more than `MAX_TEMPLATE_PLACEHOLDERS` placeholders,
    or a template without any output. Linear in the template's length. See the grammar
    in the comment above.
    """
    pieces: list[TemplatePiece] = []
    first_use: dict[str, TemplatePlaceholder] = {}
    placeholders = 0
    for piece in _scan(template):
        if isinstance(piece, TemplatePlaceholder):
            placeholders += 1
            if placeholders > MAX_TEMPLATE_PLACEHOLDERS:
                raise TemplateError(
                    f"over {MAX_TEMPLATE_PLACEHOLDERS} placeholders: split the call, or pass repeated text "
                    "as one input value",
                    template,
                    piece.start,
                )
            previous = pieces[-1] if pieces else None
            _check_placeholder(template, piece, first_use.setdefault(piece.name, piece), previous)
        pieces.append(piece)
    if not placeholder_names(pieces, "output"):
        raise TemplateError(
            "there is no {{output:NAME}} placeholder: a call must produce at least one output"
        )
    return pieces


def escape_text(text: str) -> str:
    """Escape constant text for a template: every ``{{`` becomes ``{{{{`` (nothing else needs escaping)."""
    return text.replace("{{", "{{{{")


def render_template(pieces: Sequence[TemplatePiece]) -> str:
    """The canonical template of ``pieces`` (escaped text, ``{{role:name}}`` without spaces).

    The inverse of `parse_template`: ``parse_template(render_template(p)) == p`` for valid pieces, and a
    template written canonically renders back to itself.
    """
    return "".join(
        escape_text(p.text) if isinstance(p, TemplateText) else f"{{{{{p.role}:{p.name}}}}}" for p in pieces
    )


def placeholder_names(pieces: Sequence[TemplatePiece], role: Role) -> list[str]:
    """The distinct names of ``role`` placeholders, in order of first appearance."""
    names = (p.name for p in pieces if isinstance(p, TemplatePlaceholder) and p.role == role)
    return list(dict.fromkeys(names))
