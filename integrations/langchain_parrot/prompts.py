"""Prompt templates as unrendered Parrot templates, rendered by LangChain itself.

A LangChain prompt is turned into a Parrot template by letting LangChain render it with *markers* in place
of the variables that the server will fill in: each marker is a private-use character sequence, unique to
one rendering, that `render_prompt` then cuts out of the rendered text and replaces by a ``{{input:...}}``
placeholder. Everything around the markers — the template's constant text, partial variables, values
rendered by LangChain itself, message roles and the chat template — is the text LangChain (and the
server's chat endpoint) would produce, byte for byte, by construction.

A variable can become a placeholder only where LangChain inserts its value as ``str(value)`` — which is
what the server inserts. `plain_variables` finds those uses by parsing the template:

* f-string: ``{x}`` (or ``{x!s}``), never with a format spec or ``!r``/``!a``;
* mustache: ``{{{x}}}`` or ``{{&x}}`` outside sections — ``{{x}}`` HTML-escapes its value, which the
  server does not do;
* jinja2: a bare ``{{ x }}`` (no filter, attribute, test or loop use anywhere in the template).

Other uses are rendered on the client: values known at submit time are simply given to LangChain, and a
value still being produced by the server is fetched first (one client round trip; `compile_chain`
warns about it at compile time).
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from string import Formatter
from typing import Any

from langchain_core.prompt_values import PromptValue
from langchain_core.prompts import BasePromptTemplate, ChatPromptTemplate, PromptTemplate
from langchain_core.prompts.chat import BaseStringMessagePromptTemplate, MessagesPlaceholder
from langchain_core.prompts.string import StringPromptTemplate
from langchain_core.utils.mustache import tokenize as mustache_tokens

from langchain_parrot.chat_format import ChatFormat
from langchain_parrot.errors import MissingVariableError
from langchain_parrot.messages import to_wire_messages

__all__ = [
    "NotExpressibleError",
    "Rendered",
    "identity_prompt",
    "plain_variables",
    "prompt_inputs",
    "prompt_value_text",
    "render_prompt",
]

_OPEN, _CLOSE = "\ue000", "\ue001"  # private-use characters: no tokenizer or template gives them meaning


class NotExpressibleError(Exception):
    """A marker did not come through the rendering intact: the values must be rendered on the client."""


# ------------------------------------------------------------------------------------------- analysis
def _fstring_plain(template: str) -> tuple[set[str], set[str]]:
    plain: set[str] = set()
    other: set[str] = set()
    for _, name, spec, conversion in Formatter().parse(template):
        if name is None:
            continue
        (plain if not spec and conversion in (None, "s") else other).add(name)
    return plain, other


def _mustache_plain(template: str) -> tuple[set[str], set[str]]:
    plain: set[str] = set()
    other: set[str] = set()
    depth = 0
    for tag, key in mustache_tokens(template):
        top = key.split(".", 1)[0].strip()
        if tag in ("section", "inverted section"):
            depth += 1
            other.add(top)
        elif tag == "end":
            depth -= 1
        elif tag in ("set delimiter", "partial"):
            raise NotExpressibleError(f"mustache {tag} tags")  # the whole template renders on the client
        elif tag in ("variable", "no escape"):
            ok = tag == "no escape" and depth == 0 and key.strip() == top
            (plain if ok else other).add(top)
    return plain, other


def _jinja_plain(template: str) -> tuple[set[str], set[str]]:
    from jinja2 import nodes
    from jinja2.sandbox import SandboxedEnvironment

    tree = SandboxedEnvironment().parse(template)
    plain: set[str] = set()
    other: set[str] = set()

    def visit(node: nodes.Node, parent: nodes.Node | None) -> None:
        if isinstance(node, nodes.Name):
            bare = node.ctx == "load" and isinstance(parent, nodes.Output)
            (plain if bare else other).add(node.name)
        for child in node.iter_child_nodes():
            visit(child, node)

    visit(tree, None)
    return plain, other


_ANALYZERS = {"f-string": _fstring_plain, "mustache": _mustache_plain, "jinja2": _jinja_plain}


def _string_prompts(prompt: Any) -> Iterable[tuple[PromptTemplate | None, set[str]]]:
    """The string templates inside ``prompt``, each with its variables (None: not analysable)."""
    if isinstance(prompt, StringPromptTemplate):
        yield (prompt if isinstance(prompt, PromptTemplate) else None), set(prompt.input_variables)
    elif isinstance(prompt, ChatPromptTemplate):
        for message in prompt.messages:
            if isinstance(message, MessagesPlaceholder):
                yield None, {message.variable_name}
            elif isinstance(message, (BaseStringMessagePromptTemplate,)) or hasattr(message, "prompt"):
                inner = message.prompt
                for part in inner if isinstance(inner, list) else [inner]:
                    yield from _string_prompts(part)
            elif isinstance(message, BasePromptTemplate):
                yield None, set(message.input_variables)
    elif isinstance(prompt, BasePromptTemplate):
        yield None, set(prompt.input_variables)


def plain_variables(prompt: BasePromptTemplate[Any]) -> frozenset[str]:
    """The variables of ``prompt`` whose every use inserts ``str(value)`` unchanged (see the module doc)."""
    plain: set[str] = set()
    other: set[str] = set()
    for template, variables in _string_prompts(prompt):
        if template is None:
            other |= variables
            continue
        try:
            p, o = _ANALYZERS[template.template_format](template.template)
        except (KeyError, NotExpressibleError):
            other |= variables
            continue
        plain |= p
        other |= o
    return frozenset(plain - other)


# ------------------------------------------------------------------------------------------- inputs
def prompt_inputs(prompt: BasePromptTemplate[Any], value: Any, label: str) -> dict[str, Any]:
    """The variables ``prompt`` gets from ``value``, as LangChain's prompt ``invoke`` takes them.

    A dict is the variables; anything else is the one variable of a one-variable prompt (else
    `TypeError`, as LangChain raises). A missing variable raises `MissingVariableError` naming it.
    """
    names = list(prompt.input_variables)
    if not isinstance(value, dict):
        if len(names) != 1:
            raise TypeError(
                f"{label} expects a dict with {names} as its input (it has {len(names)} variables), "
                f"got {type(value).__name__}"
            )
        return {names[0]: value}
    if missing := set(names) - set(value):
        raise MissingVariableError(label, missing, value)
    return dict(value)


# ------------------------------------------------------------------------------------------- rendering
class _Marker:
    """Stands for one value while LangChain renders: formats as its marker text, and only plainly."""

    def __init__(self, text: str, nonce: str, name: str) -> None:
        self._text = text
        self._nonce = nonce
        self._name = name

    def __format__(self, spec: str) -> str:
        if spec:
            raise NotExpressibleError(f"{self._name!r} is formatted with {spec!r}")
        return self._text

    def __str__(self) -> str:
        return self._text

    def __repr__(self) -> str:
        # Not the marker, but with its nonce: a repr in the text (the value inside a list) fails the split.
        return f"<value of {self._name!r} {self._nonce}>"


@dataclass
class Rendered:
    """A rendering with markers: the text pieces, and for each marker the item it stands for."""

    pieces: list[str | int] = field(default_factory=list)  # text, or the index of an item
    items: list[Any] = field(default_factory=list)
    names: list[str] = field(default_factory=list)  # the variable each item was given for


class _Markers:
    def __init__(self) -> None:
        # Digits only: case changes and most text filters leave them alone, so a marker that went through
        # one is still found (and the analysis in `plain_variables` keeps markers out of those uses).
        self.nonce = "".join(secrets.choice("0123456789") for _ in range(12))
        self.items: list[Any] = []
        self.names: list[str] = []

    def marker(self, item: Any, name: str) -> _Marker:
        self.items.append(item)
        self.names.append(name)
        return _Marker(f"{_OPEN}{self.nonce}:{len(self.items) - 1}{_CLOSE}", self.nonce, name)

    def split(self, text: str) -> Rendered:
        """Cut the markers out of ``text``; `NotExpressibleError` if one was altered or moved."""
        out = Rendered(items=self.items, names=self.names)
        head = f"{_OPEN}{self.nonce}:"
        rest = text
        while (start := rest.find(head)) >= 0:
            end = rest.find(_CLOSE, start)
            index = rest[start + len(head) : end] if end > 0 else ""
            if not index.isdigit() or int(index) >= len(self.items):
                raise NotExpressibleError("a marker was altered while rendering")
            if start:
                out.pieces.append(rest[:start])
            out.pieces.append(int(index))
            rest = rest[end + 1 :]
        if rest:
            out.pieces.append(rest)
        if any(isinstance(p, str) and self.nonce in p for p in out.pieces):
            raise NotExpressibleError("a marker was altered while rendering")
        return out


def prompt_value_text(value: PromptValue, chat_format: ChatFormat | None) -> str:
    """The text the engine sees for a prompt value: chat messages through the chat template, or the
    string prompt (LangChain's own string form of a chat prompt for a completion model)."""
    if chat_format is None:
        return value.to_string()
    return chat_format.template_text(to_wire_messages(value.to_messages()))


def render_prompt(
    prompt: BasePromptTemplate[Any],
    variables: Mapping[str, Any],
    placeholders: Mapping[str, Any],
    chat_format: ChatFormat | None,
) -> Rendered:
    """Render ``prompt`` with ``variables``, where each name in ``placeholders`` is a marker for its item.

    Raises `NotExpressibleError` when a marker does not come through intact (render those values on the
    client instead); other errors are LangChain's own, as ``prompt.invoke`` would raise them.
    """
    markers = _Markers()
    values = dict(variables)
    for name, item in placeholders.items():
        values[name] = markers.marker(item, name)
    if chat_format is not None and placeholders and not chat_format.transparent:
        raise NotExpressibleError("the chat template changes message contents")
    rendered = prompt.format_prompt(**values)
    return markers.split(prompt_value_text(rendered, chat_format))


def identity_prompt() -> PromptTemplate:
    """The prompt a bare model step applies to a text input (what LangChain does with a ``str``)."""
    return PromptTemplate.from_template("{input}")
