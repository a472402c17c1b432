"""A submitted call checked against its template before anything else happens: the template's grammar,
then every placeholder spec against it (`validate_call`), and the constraint a schema'd ``json`` transform
puts on its output (`schema_guide`). Pure functions of the request; failures are `TemplateError` and
`CallError` (HTTP 400)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence

from parrot.protocol import VAR_ID_PATTERN, CallError, GuidedConfig, PlaceholderSpec, TransformSpec
from parrot.template import TemplatePiece, TemplatePlaceholder, parse_template

__all__ = ["schema_guide", "validate_call"]


def _names(names: Iterable[str]) -> str:
    return ", ".join(repr(n) for n in names)


def validate_call(template: str, placeholders: Sequence[PlaceholderSpec]) -> list[TemplatePiece]:
    """Validate a call: the template's grammar, then its placeholder specs against it; return the pieces.

    Raises `TemplateError` for the template and `CallError` when: a name has two specs; a template
    placeholder has no spec, or a spec no placeholder; the roles differ; an input does not give exactly one
    of ``var_id``/``value``; an output gives ``value`` or a ``var_id`` that is not a valid id
    (`VAR_ID_PATTERN`); an input carries ``transforms`` or ``sampling`` (they describe generation).
    """
    pieces = parse_template(template)
    used = {p.name: p.role for p in pieces if isinstance(p, TemplatePlaceholder)}
    specs: dict[str, PlaceholderSpec] = {}
    for spec in placeholders:
        if spec.name in specs:
            raise CallError(f"placeholder {spec.name!r} has two specs: give one spec per name")
        specs[spec.name] = spec
    if missing := [name for name in used if name not in specs]:
        raise CallError(
            f"the template uses {_names(missing)} but no placeholder spec names them: add a spec for each"
        )
    if unused := [name for name in specs if name not in used]:
        raise CallError(
            f"placeholder spec(s) {_names(unused)} do not appear in the template: remove them, or add "
            f"{{{{{specs[unused[0]].role}:{unused[0]}}}}} to the template"
        )
    chosen = [spec.var_id for spec in specs.values() if spec.role == "output" and spec.var_id is not None]
    if len(set(chosen)) != len(chosen):
        raise CallError(f"two outputs ask for the same var_id ({chosen}): each output is its own variable")
    for name, spec in specs.items():
        if spec.role != used[name]:
            raise CallError(
                f"{name!r} is an {used[name]} in the template but its spec says role {spec.role!r}"
            )
        if spec.role == "input":
            if (spec.var_id is None) == (spec.value is None):
                got = "both" if spec.var_id is not None else "neither"
                raise CallError(
                    f"input {name!r} needs exactly one of var_id (a variable) or value (literal text); "
                    f"got {got}"
                )
            if spec.var_id == "":
                raise CallError(f"input {name!r} has an empty var_id")
            if spec.transforms or spec.sampling is not None:
                raise CallError(
                    f"input {name!r} has transforms or sampling: those apply to outputs only; "
                    "transform the producing call's output instead"
                )
        elif spec.value is not None:
            raise CallError(
                f"output {name!r} gives a value: the call generates it; remove 'value' (an output may give "
                "the 'var_id' it should get)"
            )
        elif spec.var_id is not None and not re.fullmatch(VAR_ID_PATTERN, spec.var_id):
            raise CallError(
                f"output {name!r} asks for var_id {spec.var_id!r}: a variable id is 1-64 characters among "
                "A-Z a-z 0-9 _ -"
            )
        else:
            _check_schema_transform(name, spec)
    return pieces


def schema_guide(transforms: Sequence[TransformSpec]) -> GuidedConfig | None:
    """The constraint an output's ``json`` transform with a schema puts on its generation, if it has one."""
    schema = next((t.json_schema for t in transforms if t.json_schema is not None), None)
    return None if schema is None else GuidedConfig(kind="json_schema", value=json.dumps(schema))


def _check_schema_transform(name: str, spec: PlaceholderSpec) -> None:
    """A schema'd ``json`` transform constrains the output text itself: it comes first (after ``strip`` at
    most, which keeps JSON valid), and the output's sampling brings no other constraint."""
    at = next((i for i, t in enumerate(spec.transforms) if t.json_schema is not None), None)
    if at is None:
        return
    if any(t.type != "strip" for t in spec.transforms[:at]) or any(
        t.json_schema is not None for t in spec.transforms[at + 1 :]
    ):
        raise CallError(
            f"output {name!r}: a json transform with a schema constrains the generated text, so it must be "
            "the output's first transform (after strip at most), and its only schema"
        )
    if spec.sampling is not None and spec.sampling.guided is not None:
        raise CallError(
            f"output {name!r} has both a json transform with a schema and guided sampling: keep one "
            "constraint"
        )
