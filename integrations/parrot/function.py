"""`@semantic_function`: a Python function whose docstring is an unrendered prompt.

The docstring (``inspect.cleandoc``) is the template: constant text plus ``{{input:name}}`` and
``{{output:name}}`` placeholders (grammar in `parrot.protocol`). It is parsed once, at decoration, and
cross-checked with the signature: every input is a parameter and every parameter an input. Calling the
function queues one call in the current session and returns its output variable(s) at once.
"""

from __future__ import annotations

import functools
import inspect
import keyword
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from parrot.protocol import Criteria, PlaceholderSpec, SamplingConfig, SubmitCallRequest, TransformSpec
from parrot.sampling import check_sampling
from parrot.session import current_session
from parrot.template import TemplateError, TemplatePlaceholder, parse_template, placeholder_names
from parrot.variable import Variable

__all__ = ["SemanticFunction", "semantic_function"]

Transforms = Mapping[str, TransformSpec | Sequence[TransformSpec]]


def _definition_error(func_name: str, reason: str, template: str, offset: int | None = None) -> TemplateError:
    error = TemplateError(reason, template, offset)
    error.args = (f"semantic function {func_name}(): {error.args[0]}",)
    return error


class SemanticFunction:
    """A semantic function (made by `semantic_function`). Call it with its parameters inside a session.

    Returns the output `Variable` (a future), or a tuple of them in order of appearance when the template
    has several outputs. Attributes: ``template``, ``inputs``, ``outputs`` (names), ``sampling`` (per
    output), ``transforms`` (per placeholder), ``model``, ``criteria``, ``parse_special_tokens``.
    """

    def __init__(
        self,
        func: Callable[..., Any],
        *,
        sampling: SamplingConfig,
        output_sampling: Mapping[str, SamplingConfig | Mapping[str, Any]],
        transforms: Transforms,
        model: str | None,
        criteria: Criteria | None,
        template: str | None = None,
        signature: inspect.Signature | None = None,
        parse_special_tokens: bool = False,
    ) -> None:
        self.func = func
        self.name = func.__name__
        functools.update_wrapper(self, func)
        if template is None:
            if not func.__doc__ or not func.__doc__.strip():
                raise TypeError(
                    f"semantic function {self.name}() has no docstring: its docstring is the prompt "
                    "template, e.g. '''Summarize {{input:text}}. Summary: {{output:summary}}'''"
                )
            template = inspect.cleandoc(func.__doc__)
        self.template = template
        try:
            pieces = parse_template(self.template)
        except TemplateError as e:
            raise _definition_error(self.name, e.reason, self.template, e.offset) from None
        self.inputs = placeholder_names(pieces, "input")
        self.outputs = placeholder_names(pieces, "output")
        self.signature = signature if signature is not None else inspect.signature(func)
        self._check_signature(pieces)
        self.model = model
        self.criteria = criteria
        self.parse_special_tokens = parse_special_tokens
        self.transforms = self._check_transforms(transforms)
        self.sampling = self._check_sampling(sampling, output_sampling)
        # Placeholder specs in order of first appearance; inputs are bound at call time.
        self._order = list(dict.fromkeys(p.name for p in pieces if isinstance(p, TemplatePlaceholder)))

    @classmethod
    def from_template(
        cls,
        template: str,
        *,
        name: str = "template",
        sampling: SamplingConfig | None = None,
        output_sampling: Mapping[str, SamplingConfig | Mapping[str, Any]] | None = None,
        transforms: Transforms | None = None,
        model: str | None = None,
        criteria: Criteria | None = None,
        parse_special_tokens: bool = False,
    ) -> SemanticFunction:
        """A semantic function from template text (taken verbatim, not dedented), for code that builds
        prompts at run time (the LangChain and LlamaIndex adapters). Its parameters are the template's
        inputs in order of first appearance (call it with keywords); ``name`` names it in errors;
        ``parse_special_tokens`` as `semantic_function`'s."""
        if not name.isidentifier() or keyword.iskeyword(name):
            raise ValueError(f"a semantic function's name is a Python identifier, got {name!r}")
        try:
            inputs = placeholder_names(parse_template(template), "input")
        except TemplateError as e:
            raise _definition_error(name, e.reason, template, e.offset) from None
        if bad := [n for n in inputs if keyword.iskeyword(n)]:
            raise _definition_error(
                name, f"input name(s) {', '.join(map(repr, bad))} are Python keywords: rename them", template
            )
        params = [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD) for n in inputs]

        def call(*args: Any, **kwargs: Any) -> Any:  # names the function; calls go through __call__
            raise NotImplementedError

        call.__name__ = call.__qualname__ = name
        call.__doc__ = None
        return cls(
            call,
            sampling=sampling or SamplingConfig(),
            output_sampling=output_sampling or {},
            transforms=transforms or {},
            model=model,
            criteria=criteria,
            template=template,
            signature=inspect.Signature(params),
            parse_special_tokens=parse_special_tokens,
        )

    def _check_signature(self, pieces: list[Any]) -> None:
        params = self.signature.parameters
        for p in params.values():
            if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD, p.POSITIONAL_ONLY):
                raise TypeError(
                    f"semantic function {self.name}(): parameter {p.name!r} is {p.kind.description}; "
                    "use plain named parameters, one per {{input:...}} placeholder"
                )
        first = {p.name: p for p in reversed(pieces) if isinstance(p, TemplatePlaceholder)}
        for name in self.inputs:
            if name not in params:
                have = ", ".join(params) or "none"
                raise _definition_error(
                    self.name,
                    f"{{{{input:{name}}}}} is not a parameter of {self.name}() (parameters: {have}): "
                    f"add a parameter {name!r} or fix the placeholder's name",
                    self.template,
                    first[name].start,
                )
        for name in self.outputs:
            if name in params:
                raise _definition_error(
                    self.name,
                    f"parameter {name!r} of {self.name}() is an {{{{output:{name}}}}}: outputs are "
                    "returned by the call, not passed to it; remove the parameter",
                    self.template,
                    first[name].start,
                )
        if unused := [name for name in params if name not in self.inputs]:
            raise _definition_error(
                self.name,
                f"parameter(s) {', '.join(map(repr, unused))} of {self.name}() have no placeholder in the "
                f"docstring: use them as {{{{input:{unused[0]}}}}} or remove them",
                self.template,
            )

    def _check_transforms(self, transforms: Transforms) -> dict[str, list[TransformSpec]]:
        checked: dict[str, list[TransformSpec]] = {}
        for name, specs in transforms.items():
            specs = [specs] if isinstance(specs, TransformSpec) else list(specs)
            if not all(isinstance(s, TransformSpec) for s in specs):
                raise TypeError(f"{self.name}(): transforms[{name!r}] must be P.transforms.* specs")
            if name in self.inputs:
                if any(s.type != "render" for s in specs):
                    raise ValueError(
                        f"{self.name}(): input {name!r} may only take P.transforms.render() "
                        "(transforms apply to outputs; render lets an input take any value as str(value))"
                    )
            elif name not in self.outputs:
                raise ValueError(
                    f"{self.name}(): transforms name {name!r}, which is not a placeholder of the docstring "
                    f"(inputs: {self.inputs}, outputs: {self.outputs})"
                )
            checked[name] = specs
        return checked

    def _check_sampling(
        self, base: SamplingConfig, per_output: Mapping[str, SamplingConfig | Mapping[str, Any]]
    ) -> dict[str, SamplingConfig]:
        sampling = {name: base for name in self.outputs}
        for name, override in per_output.items():
            if name not in self.outputs:
                raise ValueError(
                    f"{self.name}(): sampling names {name!r}, which is not an output "
                    f"(outputs: {self.outputs})"
                )
            if isinstance(override, SamplingConfig):
                sampling[name] = override
            else:
                sampling[name] = SamplingConfig.model_validate({**base.model_dump(), **override})
        # Refused here, at definition, rather than by the engine when a `get` finally runs the call.
        for name, config in sampling.items():
            check_sampling(config, where=f"semantic function {self.name}(), output {name!r}: ")
        return sampling

    def _input_spec(self, name: str, value: Any) -> tuple[PlaceholderSpec, Variable | None]:
        if isinstance(value, Variable):
            return PlaceholderSpec(name=name, role="input"), value
        if isinstance(value, str):
            return PlaceholderSpec(name=name, role="input", value=value), None
        if any(s.type == "render" for s in self.transforms.get(name, [])):
            return PlaceholderSpec(name=name, role="input", value=str(value)), None
        raise TypeError(
            f"{self.name}(): input {name!r} got a {type(value).__name__}; pass a str or a P.Variable, or "
            f"declare transforms={{{name!r}: [P.transforms.render()]}} to send str(value)"
        )

    def __call__(self, *args: Any, **kwargs: Any) -> Variable | tuple[Variable, ...]:
        session = current_session()
        try:
            bound = self.signature.bind(*args, **kwargs)
        except TypeError as e:
            raise TypeError(f"{self.name}(): {e}") from None
        bound.apply_defaults()
        specs: list[PlaceholderSpec] = []
        variables: dict[str, Variable] = {}
        for name in self._order:
            if name in self.outputs:
                specs.append(
                    PlaceholderSpec(
                        name=name,
                        role="output",
                        transforms=self.transforms.get(name, []),
                        sampling=self.sampling[name],
                    )
                )
                continue
            spec, var = self._input_spec(name, bound.arguments[name])
            specs.append(spec)
            if var is not None:
                variables[name] = var
        request = SubmitCallRequest(
            template=self.template,
            placeholders=specs,
            func_name=self.name,
            model=self.model,
            criteria=self.criteria,
            parse_special_tokens=self.parse_special_tokens or None,  # not sent unless asked for
        )
        made = session._enqueue_call(self.name, request, variables, self.outputs)
        outputs = tuple(made[name] for name in self.outputs)
        return outputs[0] if len(outputs) == 1 else outputs

    def __repr__(self) -> str:
        return f"<parrot.SemanticFunction {self.name}({', '.join(self.inputs)}) -> {', '.join(self.outputs)}>"


def semantic_function(
    *,
    max_tokens: int | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    seed: int | None = None,
    stop: str | Sequence[str] | None = None,
    ignore_eos: bool | None = None,
    sampling: Mapping[str, SamplingConfig | Mapping[str, Any]] | None = None,
    transforms: Transforms | None = None,
    model: str | None = None,
    criteria: Criteria | None = None,
    parse_special_tokens: bool = False,
) -> Callable[[Callable[..., Any]], SemanticFunction]:
    """Make a semantic function: the decorated function's docstring is its prompt template.

    The sampling keywords apply to every output (unset ones take `SamplingConfig`'s defaults);
    ``sampling={"out": {"max_tokens": 8}}`` overrides them for one output. ``transforms`` maps an output
    name to `P.transforms` specs applied server-side in order (or an input name to
    ``[P.transforms.render()]`` to accept any value as ``str(value)``). ``model`` picks the model;
    ``criteria`` (`P.LATENCY`/`P.THROUGHPUT`) marks the outputs wanted at submit time. Template errors and
    a template that disagrees with the signature raise at decoration (`TemplateError`, naming the function),
    and so do sampling values the engine would refuse (`ValueError`: ``temperature=-1``, ``top_p=0``,
    ``max_tokens=0``...). Special-token strings (``<|im_end|>``) in input values are plain text, so a
    user's text cannot forge a turn; ``parse_special_tokens=True`` makes them control tokens (only for
    values the caller controls).
    """
    given = {
        "max_tokens": max_tokens,
        "temperature": temperature,
        "top_p": top_p,
        "top_k": top_k,
        "seed": seed,
        "stop": [stop] if isinstance(stop, str) else (list(stop) if stop is not None else None),
        "ignore_eos": ignore_eos,
    }
    base = SamplingConfig.model_validate({k: v for k, v in given.items() if v is not None})

    def decorate(func: Callable[..., Any]) -> SemanticFunction:
        return SemanticFunction(
            func,
            sampling=base,
            output_sampling=sampling or {},
            transforms=transforms or {},
            model=model,
            criteria=criteria,
            parse_special_tokens=parse_special_tokens,
        )

    return decorate
