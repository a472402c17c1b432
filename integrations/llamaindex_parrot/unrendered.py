"""Turn a LlamaIndex prompt into an unrendered Parrot call: constant text, input placeholders, one output.

LlamaIndex renders a prompt through several layers — the `SelectorPromptTemplate` picks a template for
the LLM, partial values (``prompt.kwargs``) merge with the call's arguments, ``template_var_mappings`` and
``function_mappings`` apply, an output parser may append format instructions, and the LLM adds its system
prompt, query wrapper and ``completion_to_prompt``. Rather than re-implement those layers, the adapter lets
LlamaIndex render the prompt once with a unique *marker* in place of every value and cuts the result at the
markers: the text between them is the template's constant text, each marker becomes an
``{{input:name}}`` placeholder, and ``{{output:...}}`` goes at the end. The rendered prompt the server
builds is then LlamaIndex's own rendering by construction.

That holds only where LlamaIndex inserts values verbatim. So every conversion is checked: LlamaIndex
renders the prompt a second time with the real values (a probe text for a value that is still a
server-side variable) and the result must equal the Parrot template filled with the same values. When it
does not (a function mapping computing from a value, a ``completion_to_prompt`` rewriting the text), a
prompt whose values are all known is sent rendered, as one input; one with a pending variable cannot be,
and raises `PromptConversionError`.
"""

from __future__ import annotations

import keyword
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import parrot as P
from llama_index.core.base.llms.base import BaseLLM
from llama_index.core.prompts import BasePromptTemplate, SelectorPromptTemplate
from parrot.protocol import SamplingConfig, TransformSpec
from parrot.template import TemplatePiece, TemplatePlaceholder, TemplateText, parse_template, render_template

from llamaindex_parrot.errors import MissingTemplateVariableError, PromptConversionError

__all__ = ["Part", "UnrenderedCall", "Value", "unrender"]

# A value bound to a template variable: known text, a variable of the session (an earlier call's output,
# still pending on the server), or a sequence of those joined without separator (how a tree-summarize
# reduce step receives the map outputs with the "\n\n" between them).
Part = str | P.Variable
Value = Part | Sequence[Part]

# Private-use code points: never produced by LlamaIndex's templates, and free of the braces that its
# formatter and the Parrot grammar care about.
_MARK_OPEN, _MARK_CLOSE = "\ue000", "\ue001"
_MARK = re.compile(f"{_MARK_OPEN}(\\d+){_MARK_CLOSE}")

Render = Callable[[dict[str, Any]], str]


@dataclass(frozen=True)
class UnrenderedCall:
    """One semantic function call built from a LlamaIndex prompt.

    ``template`` is the Parrot template (its last placeholder is the output ``output``), ``inputs`` the
    value of each input placeholder, ``name`` the semantic function's name (for the server's messages),
    ``rendered`` whether the prompt had to be sent rendered (see the module docstring).
    """

    template: str
    inputs: dict[str, Part]
    output: str
    name: str
    rendered: bool = False
    _pieces: list[TemplatePiece] = field(default_factory=list, repr=False, compare=False)

    def prompt_text(self, probe: Callable[[P.Variable], str] | None = None) -> str:
        """The prompt the server renders (everything before the output), with ``probe(var)`` standing in
        for each input that is a pending variable (without ``probe``, every input must be text)."""
        out: list[str] = []
        for piece in self._pieces or parse_template(self.template):
            if isinstance(piece, TemplateText):
                out.append(piece.text)
            elif piece.role == "output":
                break
            else:
                value = self.inputs[piece.name]
                if isinstance(value, str):
                    out.append(value)
                elif probe is None:
                    raise ValueError(f"input {piece.name!r} is a pending variable: pass a probe")
                else:
                    out.append(probe(value))
        return "".join(out)

    def submit(
        self,
        sampling: SamplingConfig,
        *,
        model: str | None = None,
        transforms: Sequence[TransformSpec] = (),
    ) -> P.Variable:
        """Queue the call in the current `parrot.Session` and return its output variable (a future).

        ``transforms`` apply to the output on the server (e.g. `parrot.transforms.strip`).
        """
        function = P.SemanticFunction.from_template(
            self.template,
            name=self.name,
            sampling=sampling,
            transforms={self.output: list(transforms)} if transforms else None,
            model=model,
        )
        out = function(**self.inputs)
        assert isinstance(out, P.Variable)  # one output placeholder: one variable
        return out


def selected_template(prompt: BasePromptTemplate, llm: BaseLLM | None) -> BasePromptTemplate:
    """The template LlamaIndex formats for ``llm`` (a selector picks by the LLM, e.g. chat or not)."""
    return prompt.select(llm=llm) if isinstance(prompt, SelectorPromptTemplate) else prompt


def check_variables(prompt: BasePromptTemplate, llm: BaseLLM | None, given: Mapping[str, Any]) -> None:
    """Raise `MissingTemplateVariableError` for template variables with no value.

    A value comes from the call, a partial (``prompt.kwargs``) or a function mapping, under its own name
    or the one ``template_var_mappings`` maps it to. LlamaIndex's formatter would leave ``{name}`` in the
    text and send it to the model; the adapter refuses instead.
    """
    template = selected_template(prompt, llm)
    mappings = template.template_var_mappings or {}
    provided = {*template.kwargs, *given, *(template.function_mappings or {})}
    covered = {mappings.get(name, name) for name in provided}
    missing = list(dict.fromkeys(v for v in template.template_vars if v not in covered))
    if missing:
        text = template.get_template(llm=llm)
        raise MissingTemplateVariableError(missing, text, sorted({*template.kwargs, *given}))


def unrender(
    render: Render,
    prompt: BasePromptTemplate,
    values: Mapping[str, Value],
    *,
    llm: BaseLLM | None,
    output: str = "answer",
    allow_rendered: bool = True,
) -> UnrenderedCall:
    """Convert ``prompt`` with ``values`` into an `UnrenderedCall`.

    ``render(kwargs)`` is how LlamaIndex turns the prompt and keyword values into the final prompt text
    (e.g. ``lambda kw: llm._get_prompt(prompt, **kw)`` for ``predict``); it is called with marker values
    and once more with the real (or probe) values to check the conversion. ``values`` override the
    prompt's partials, as in LlamaIndex. ``allow_rendered``: when the check fails and every value is
    known text, send the rendered prompt as one input instead of raising `PromptConversionError`.
    """
    check_variables(prompt, llm, values)
    template = selected_template(prompt, llm)
    all_values: dict[str, Value] = {**template.kwargs, **values}
    names = list(all_values)
    name = _function_name(template)
    pending = any(_has_variable(v) for v in all_values.values())
    probes = _Probes()
    try:
        marked = render({k: f"{_MARK_OPEN}{i}{_MARK_CLOSE}" for i, k in enumerate(names)})
        expected = render({k: probes.text(v) for k, v in all_values.items()})
    except Exception as e:  # a function mapping or hook that cannot take marker text
        if pending or not allow_rendered:
            raise PromptConversionError(f"LlamaIndex could not render the prompt with markers: {e!r}") from e
        return _rendered_call(render(dict(all_values)), name, output)
    call = _build(marked, names, all_values, output, name)
    got = call.prompt_text(probes.text)
    if got == expected:
        return call
    if pending or not allow_rendered:
        at = next((i for i, (a, b) in enumerate(zip(got, expected, strict=False)) if a != b), len(got))
        raise PromptConversionError(
            "this prompt cannot be sent unrendered: LlamaIndex's rendering is not a plain substitution of "
            "its variables (a function_mappings entry or completion_to_prompt transforms them); at "
            f"character {at} the converted prompt has {got[at : at + 40]!r} where LlamaIndex renders "
            f"{expected[at : at + 40]!r}. Use values that LlamaIndex inserts verbatim, or LlamaIndex's own "
            "synthesizer for this prompt"
        )
    return _rendered_call(expected, name, output)


def _has_variable(value: Value) -> bool:
    if isinstance(value, str):
        return False
    if isinstance(value, P.Variable):
        return True
    return any(isinstance(part, P.Variable) for part in value)


class _Probes:
    """Stand-in text for pending variables (unique per variable), for the conversion check."""

    def __init__(self) -> None:
        self._ids: dict[int, str] = {}

    def text(self, value: Value) -> str:
        if isinstance(value, str):
            return value
        if isinstance(value, P.Variable):
            return self._ids.setdefault(id(value), f"<parrot variable {len(self._ids)}>")
        return "".join(self.text(part) for part in value)


def _build(
    marked: str, names: list[str], values: Mapping[str, Value], output: str, name: str
) -> UnrenderedCall:
    """Cut the marker rendering into pieces: text, one placeholder per value (or per part of a sequence)."""
    pieces: list[TemplatePiece] = []
    inputs: dict[str, Part] = {}
    by_key: dict[str, str] = {}  # template variable -> placeholder name (a str value is one input)
    by_var: dict[int, str] = {}  # id(Variable) -> placeholder name (a variable used twice is one input)
    taken: set[str] = set()

    def placeholder(base: str, value: Part) -> TemplatePlaceholder:
        key_map: dict[Any, str] = by_var if isinstance(value, P.Variable) else by_key
        key: Any = id(value) if isinstance(value, P.Variable) else base
        if key not in key_map:
            key_map[key] = _fresh_name(base, taken)
            inputs[key_map[key]] = value
        return TemplatePlaceholder("input", key_map[key])

    position = 0
    for match in _MARK.finditer(marked):
        if match.start() > position:
            pieces.append(TemplateText(marked[position : match.start()]))
        position = match.end()
        key = names[int(match.group(1))]
        value = values[key]
        if isinstance(value, (str, P.Variable)):
            pieces.append(placeholder(key, value))
            continue
        for part in value:  # a joined value: variables become placeholders, text between them stays text
            pieces.append(TemplateText(part) if isinstance(part, str) else placeholder(key, part))
    if position < len(marked):
        pieces.append(TemplateText(marked[position:]))
    out_name = _fresh_name(output, taken)
    pieces = [p for p in pieces if not (isinstance(p, TemplateText) and not p.text)]
    pieces.append(TemplatePlaceholder("output", out_name))
    return UnrenderedCall(render_template(pieces), inputs, out_name, name, _pieces=pieces)


def _rendered_call(text: str, name: str, output: str) -> UnrenderedCall:
    pieces: list[TemplatePiece] = [
        TemplatePlaceholder("input", "prompt"),
        TemplatePlaceholder("output", output),
    ]
    return UnrenderedCall(
        render_template(pieces), {"prompt": text}, output, name, rendered=True, _pieces=pieces
    )


def _fresh_name(base: str, taken: set[str]) -> str:
    """A placeholder name from a LlamaIndex variable name: an identifier, not a keyword, not taken."""
    name = re.sub(r"\W", "_", base) or "value"
    if not name.isidentifier():
        name = "v_" + name
    if keyword.iskeyword(name):
        name += "_"
    candidate, n = name, 1
    while candidate in taken:
        candidate = f"{name}_{n}"
        n += 1
    taken.add(candidate)
    return candidate


def _function_name(template: BasePromptTemplate) -> str:
    kind = template.metadata.get("prompt_type", "custom")
    kind = getattr(kind, "value", kind)
    name = re.sub(r"\W", "_", f"llamaindex_{kind}")
    return name if name.isidentifier() and not keyword.iskeyword(name) else "llamaindex_prompt"
