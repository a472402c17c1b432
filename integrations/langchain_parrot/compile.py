"""`compile_chain`: an LCEL chain whose ``prompt -> model -> parsers`` runs become semantic function calls.

```python
from langchain_parrot import ChatParrot, compile_chain

chat = ChatParrot(base_url=url, max_tokens=64)  # renders with the chat template the server publishes
outline = ChatPromptTemplate.from_messages([("system", "You plan essays."), ("human", "Outline {topic}")])
essay = ChatPromptTemplate.from_messages([("system", "You write essays."), ("human", "Write: {outline}")])
chain = {"outline": outline | chat | StrOutputParser()} | essay | chat | StrOutputParser()

compiled = compile_chain(chain)
compiled.invoke({"topic": "parrots"})   # both calls in one submission; the outline never leaves the server
```

Every ``prompt -> model -> parser*`` run with a Parrot model (`ChatParrot`, `ParrotLLM`, bound or not)
becomes one unrendered call: the template is the prompt as LangChain renders it (chat messages through the
model's chat template, `ChatFormat`), variables filled by earlier steps are placeholders bound to those
steps' output variables, bound parameters (``stop``, ``max_tokens``, ``temperature``...) are the call's
sampling, and the parsers are server-side transforms (`langchain_parrot.parsers`). The LCEL structure
around them — `RunnableSequence`, `RunnableParallel` (and dict literals), `RunnablePassthrough` and
``.assign``, `RunnablePick`, `RunnableBinding`, `RunnableEach` (``.map()``), ``itemgetter`` and
``str.join`` as functions — is run by the compiled chain on the client while it *traces* the chain: it
passes futures along, so the whole chain is sent as one submission and only its outputs are fetched.

Anything else (a Python function, another provider's model, a router) runs on the client, on concrete
values: what it needs from earlier model steps is fetched first. `compile_chain` names those steps in one
`ClientSideStepWarning`. A parser with no transform is an `UnsupportedParserError` at compile time.

Where a compiled chain differs from the original (same server, greedy decoding: same prompts, same text):

* a compiled model step needs ``max_tokens`` (the server reserves prompt + max_tokens per call; used
  directly, ``None`` means "up to the context window"): `CompileError` otherwise;
* a chat model's ``AIMessage`` carries its content only — no usage or response metadata;
* a parser that fails on the server (invalid JSON or XML, a regex that does not match) raises
  `ServerParserError`: LangChain's ``OutputParserException``, with the whole refused text as
  ``llm_output`` (the server sends it with the failure, also for an output downstream of the failed
  parser), and also the `parrot.VariableFailedError` of the output; a key that is missing from a
  server-side lookup stays a `parrot.VariableFailedError` instead of LangChain's ``KeyError`` (a missing
  `RunnablePick` key is None in LangChain); pydantic validation runs on the client and raises LangChain's
  own error;
* callbacks see one run for the whole compiled chain (client-side steps still report their own).
"""

from __future__ import annotations

import functools
import operator
import warnings
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from typing import Any, cast

import parrot as P
from langchain_core.language_models import BaseLanguageModel
from langchain_core.prompts import BasePromptTemplate
from langchain_core.runnables import (
    Runnable,
    RunnableBinding,
    RunnableConfig,
    RunnableLambda,
    RunnableParallel,
    RunnablePassthrough,
    RunnableSequence,
)
from langchain_core.runnables.base import RunnableEachBase, coerce_to_runnable
from langchain_core.runnables.passthrough import RunnableAssign, RunnablePick
from parrot.protocol import Criteria

from langchain_parrot._base import ParrotModelBase
from langchain_parrot._http import ServerConnection
from langchain_parrot.chat_format import ChatFormat
from langchain_parrot.chat_models import ChatParrot
from langchain_parrot.errors import ClientSideStepWarning, CompileError
from langchain_parrot.parsers import OutputPlan, is_output_parser, plan_output
from langchain_parrot.runner import in_session, in_session_async, run_async, run_sync
from langchain_parrot.steps import (
    AssignStep,
    ClientStep,
    EachStep,
    ItemStep,
    JoinStep,
    ModelStep,
    ParallelStep,
    PassthroughStep,
    PickStep,
    SequenceStep,
    Step,
)
from langchain_parrot.streaming import astream_text, stream_kind, stream_text
from langchain_parrot.submission import Program, RunClient, Submission
from langchain_parrot.values import Pending

__all__ = ["ClientSideStepWarning", "CompiledChain", "compile_chain"]


# --------------------------------------------------------------------------------------------- building
def _bound_model(runnable: Any) -> tuple[ParrotModelBase, dict[str, Any]] | None:
    """A Parrot model and the keywords bound to it (``model.bind(stop=...)``), or None."""
    kwargs: dict[str, Any] = {}
    while isinstance(runnable, RunnableBinding):
        kwargs = {**runnable.kwargs, **kwargs}
        runnable = runnable.bound
    if isinstance(runnable, ParrotModelBase):
        return runnable, kwargs
    return None


def _join_separator(func: Any) -> str | None:
    """The separator of a ``separator.join`` bound method, else None."""
    owner = getattr(func, "__self__", None)
    if isinstance(owner, str) and getattr(func, "__name__", None) == "join":
        return owner
    return None


class _Builder:
    """Walks an LCEL tree into `Step`s, noting the models used and the steps left to the client."""

    def __init__(self, chat_format: ChatFormat | None) -> None:
        self.chat_format = chat_format
        self.models: list[ParrotModelBase] = []
        self.client_side: list[str] = []  # why each client-side step is one
        self.count = 0

    def client(self, runnable: Runnable[Any, Any], why: str | None) -> ClientStep:
        label = runnable.get_name()
        if why is not None:
            self.client_side.append(f"{label!r} ({why})")
        return ClientStep(runnable, label)

    def build(self, runnable: Any) -> Step:
        if isinstance(runnable, RunnableSequence):
            return SequenceStep(self.sequence(runnable.steps))
        if isinstance(runnable, RunnableParallel):
            return ParallelStep({k: self.build(v) for k, v in runnable.steps__.items()})
        if isinstance(runnable, RunnableAssign):
            return AssignStep(cast(ParallelStep, self.build(runnable.mapper)))
        if isinstance(runnable, RunnablePick):
            return PickStep(runnable.keys)
        if type(runnable) is RunnablePassthrough and runnable.func is None and runnable.afunc is None:
            return PassthroughStep()
        if isinstance(runnable, RunnableEachBase):
            return EachStep(self.build(runnable.bound))
        if isinstance(runnable, RunnableLambda):
            return self.function(runnable)
        if isinstance(runnable, (BasePromptTemplate, ParrotModelBase)) or is_output_parser(runnable):
            return SequenceStep(self.sequence([runnable]))
        if isinstance(runnable, RunnableBinding):
            if _bound_model(runnable) is not None:
                return SequenceStep(self.sequence([runnable]))
            if not runnable.kwargs and type(runnable) is RunnableBinding:
                return self.build(runnable.bound)  # with_config(...) on a chain: its steps compile as usual
        if isinstance(runnable, BaseLanguageModel):
            return self.client(runnable, "not a Parrot model")
        return self.client(runnable, "not an LCEL step compile_chain knows")

    def function(self, runnable: RunnableLambda[Any, Any]) -> Step:
        func = getattr(runnable, "func", None)
        if isinstance(func, operator.itemgetter):
            reduced = func.__reduce__()  # (itemgetter, its items)
            return ItemStep(tuple(reduced[1]))
        if (separator := _join_separator(func)) is not None:
            return JoinStep(separator)
        return self.client(runnable, "a Python function")

    def model_format(self, model: ParrotModelBase) -> ChatFormat | bool | None:
        """The chat format for ``model`` (None: a completion model), or False: none available."""
        if not isinstance(model, ChatParrot):
            return None
        fmt = self.chat_format or model.resolved_chat_format()
        return fmt if fmt is not None else False

    def sequence(self, items: Sequence[Runnable[Any, Any]]) -> list[Step]:
        steps: list[Step] = []
        i = 0
        while i < len(items):
            item = items[i]
            prompt = item if isinstance(item, BasePromptTemplate) else None
            target = items[i + 1] if prompt is not None and i + 1 < len(items) else item
            bound = _bound_model(target)
            if bound is None:
                if prompt is not None or is_output_parser(item):  # LangChain's own step, on the client
                    steps.append(self.client(item, None))
                else:
                    steps.append(self.build(item))
                i += 1
                continue
            model, kwargs = bound
            fmt = self.model_format(model)
            end = i + 1 if prompt is None else i + 2
            parsers = []
            while end < len(items) and is_output_parser(items[end]):
                parsers.append(items[end])
                end += 1
            kwargs = dict(kwargs)
            response_format = kwargs.pop("response_format", None)
            plan = plan_output(parsers, chat=isinstance(model, ChatParrot)) if fmt is not False else None
            why = (
                "a ChatParrot without chat_format, whose server publishes no chat template"
                if plan is None
                else _client_only(kwargs) or _constrain(plan, response_format)
            )
            if plan is None or why is not None:
                if prompt is not None:
                    steps.append(self.client(prompt, None))
                steps.append(self.client(target, why))  # the model with its bindings, as LangChain runs it
                steps.extend(self.client(p, None) for p in parsers)
            else:
                self.count += 1
                self.models.append(model)
                steps.append(
                    ModelStep(
                        label=f"lc{self.count}_{type(prompt).__name__ if prompt is not None else 'input'}",
                        prompt=prompt,
                        model=model,
                        kwargs=kwargs,
                        plan=plan,
                        chat_format=fmt,  # type: ignore[arg-type]
                    )
                )
            i = end
        return steps


_TOOL_KWARGS = ("tools", "tool_choice", "parallel_tool_calls")


def _client_only(kwargs: Mapping[str, Any]) -> str | None:
    """Why a bound model step runs on the client (its answer is not text a semantic call produces)."""
    if any(k in kwargs for k in _TOOL_KWARGS):
        return "a model with tools answers tool calls, which the chat endpoint returns, not a semantic call"
    return None


def _constrain(plan: OutputPlan, response_format: Any) -> str | None:
    """Put ``response_format``'s schema on the plan's JSON transform (generated under it: valid by
    construction, `parrot.transforms.json`); the reason the step must run on the client when it cannot."""
    if response_format is None:
        return None
    kind = response_format.get("type") if isinstance(response_format, Mapping) else None
    spec = response_format.get("json_schema") if kind == "json_schema" else None
    schema = spec.get("schema") if isinstance(spec, Mapping) else {"type": "object"}
    if kind not in ("json_schema", "json_object") or not isinstance(schema, Mapping):
        return f"response_format {response_format!r} has no semantic-call equivalent"
    first = plan.transforms[0] if plan.transforms else None
    if first is None or first.type != "json":
        return "a response_format needs a JSON parser right after the model in a compiled chain"
    plan.transforms[0] = first.model_copy(update={"json_schema": dict(schema)})
    return None


def compile_chain(
    runnable: Runnable[Any, Any] | dict[str, Any],
    *,
    chat_format: ChatFormat | None = None,
    criteria: Criteria | None = None,
    timeout: float | None = None,
) -> CompiledChain:
    """Compile an LCEL chain into a `CompiledChain` (see the module docstring).

    ``chat_format`` renders chat prompts for every `ChatParrot` of the chain (default: each model's own
    ``chat_format``, else the chat template its server publishes; a ChatParrot with none runs on the
    client). ``criteria`` is what the outputs are
    fetched with (default: ``latency`` for ``invoke``, ``throughput`` for ``batch``). ``timeout`` is how
    long a run waits for any one output (default: the models' ``timeout``).

    Raises `UnsupportedParserError` for a parser without a server-side transform, `CompileError` when
    the chain's Parrot models are on different servers, `TypeError` for a bound argument a model does
    not take. Warns `ClientSideStepWarning` once, naming the steps that run on the client.
    """
    if isinstance(runnable, dict) or (callable(runnable) and not isinstance(runnable, Runnable)):
        runnable = coerce_to_runnable(runnable)  # as LCEL does: a dict is a RunnableParallel
    if not isinstance(runnable, Runnable):
        raise CompileError(f"compile_chain takes a LangChain Runnable, got {type(runnable).__name__}")
    builder = _Builder(chat_format)
    step = builder.build(runnable)
    urls = sorted({m.base_url for m in builder.models})  # server roots: ".../v1" is the same server
    if len(urls) > 1:
        raise CompileError(
            f"the chain's Parrot models are on different servers ({', '.join(urls)}): a compiled chain "
            "runs on one server; compile the parts separately"
        )
    if builder.client_side:
        warnings.warn(
            "compile_chain: these steps run on the client, not on the Parrot server: "
            + ", ".join(builder.client_side)
            + ". What they need from earlier model steps is fetched first (a client round trip).",
            ClientSideStepWarning,
            stacklevel=2,
        )
    if timeout is None and builder.models:
        timeouts = [m.timeout for m in builder.models]
        timeout = None if None in timeouts else max(t for t in timeouts if t is not None)
    connection = builder.models[0].connection if builder.models else None
    return CompiledChain(runnable, step, connection, criteria, timeout)


# ------------------------------------------------------------------------------------------- the runnable
def _externals(value: Any) -> Any:
    """An input with its `parrot.Variable`s as pending values (so they are bound, not fetched)."""
    if isinstance(value, P.Variable):
        return Pending(variable=value)
    if isinstance(value, dict):
        return {k: _externals(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_externals(v) for v in value]
    return value


class CompiledChain(Runnable[Any, Any]):
    """A compiled LCEL chain: a Runnable like the original, run as semantic calls on a Parrot server.

    ``invoke``/``ainvoke`` run one input in one session (one submission; only the outputs are
    fetched), ``batch``/``abatch`` run all inputs in one session at once. `submit` queues a run in your
    own session and returns its output variables without waiting. `explain` shows which steps run where.
    Outputs equal what the original chain gives on the same server (greedy decoding), except that a chat
    model's ``AIMessage`` carries no usage or response metadata (the server's variables have none).
    """

    def __init__(
        self,
        source: Runnable[Any, Any],
        step: Step,
        connection: ServerConnection | None,
        criteria: Criteria | None,
        timeout: float | None,
    ) -> None:
        self.source = source
        self.step = step
        self.connection = connection
        self.criteria = criteria
        self.timeout = timeout
        self.name = f"Compiled{source.get_name()}"

    # --------------------------------------------------------------------------------------- schema
    @property
    def InputType(self) -> Any:
        return self.source.InputType

    @property
    def OutputType(self) -> Any:
        return self.source.OutputType

    def get_input_schema(self, config: RunnableConfig | None = None) -> Any:
        return self.source.get_input_schema(config)

    def get_output_schema(self, config: RunnableConfig | None = None) -> Any:
        return self.source.get_output_schema(config)

    def explain(self) -> str:
        """Which steps run server-side (as semantic calls) and which on the client, in order."""
        return "\n".join(self.step.describe())

    # ------------------------------------------------------------------------------------------ runs
    def _program(self, value: Any, criteria: Criteria | None) -> Program:
        sub = Submission(criteria)
        out = yield from self.step.run(_externals(value), sub)
        return (yield from sub.collect(out))

    def _run(self, inputs: list[Any], configs: list[RunnableConfig], criteria: Criteria | None) -> list[Any]:
        def invoke(request: RunClient, i: int) -> Any:
            return request.runnable.invoke(request.input, configs[i])

        def work() -> list[Any]:
            programs = [self._program(v, criteria) for v in inputs]
            return run_sync(programs, timeout=self.timeout, invoke=invoke)

        return in_session(self.connection, work)

    async def _arun(
        self, inputs: list[Any], configs: list[RunnableConfig], criteria: Criteria | None
    ) -> list[Any]:
        async def ainvoke(request: RunClient, i: int) -> Any:
            return await request.runnable.ainvoke(request.input, configs[i])

        async def work() -> list[Any]:
            programs = [self._program(v, criteria) for v in inputs]
            return await run_async(programs, timeout=self.timeout, ainvoke=ainvoke)

        return await in_session_async(self.connection, work)

    def _invoke_one(self, value: Any, config: RunnableConfig) -> Any:
        (result,) = self._run([value], [config], self.criteria or P.LATENCY)
        if isinstance(result, Exception):
            raise result
        return result

    async def _ainvoke_one(self, value: Any, config: RunnableConfig) -> Any:
        (result,) = await self._arun([value], [config], self.criteria or P.LATENCY)
        if isinstance(result, Exception):
            raise result
        return result

    def invoke(self, input: Any, config: RunnableConfig | None = None, **kwargs: Any) -> Any:
        return self._call_with_config(self._invoke_one, input, config)  # type: ignore[arg-type]  # LangChain passes config= to it

    async def ainvoke(self, input: Any, config: RunnableConfig | None = None, **kwargs: Any) -> Any:
        return await self._acall_with_config(self._ainvoke_one, input, config)  # type: ignore[arg-type]  # LangChain passes config= to it

    def _batch(self, inputs: list[Any], config: list[RunnableConfig]) -> list[Any]:
        return self._run(inputs, config, self.criteria or P.THROUGHPUT)

    async def _abatch(self, inputs: list[Any], config: list[RunnableConfig]) -> list[Any]:
        return await self._arun(inputs, config, self.criteria or P.THROUGHPUT)

    def batch(
        self,
        inputs: list[Any],
        config: RunnableConfig | list[RunnableConfig] | None = None,
        *,
        return_exceptions: bool = False,
        **kwargs: Any,
    ) -> list[Any]:
        """Run every input in one session, all submitted at once (one round of fetches)."""
        # LangChain passes config= to a function that takes it (the stubs list only its other forms).
        run = self._batch
        return self._batch_with_config(run, inputs, config, return_exceptions=return_exceptions)  # type: ignore[arg-type]

    async def abatch(
        self,
        inputs: list[Any],
        config: RunnableConfig | list[RunnableConfig] | None = None,
        *,
        return_exceptions: bool = False,
        **kwargs: Any,
    ) -> list[Any]:
        """``await`` form of `batch`."""
        run = self._abatch  # as in `batch`
        return await self._abatch_with_config(run, inputs, config, return_exceptions=return_exceptions)  # type: ignore[arg-type]

    def stream(self, input: Any, config: RunnableConfig | None = None, **kwargs: Any) -> Iterator[Any]:
        """The final model step's text as the server writes it: ``str`` chunks (a chain ending in
        ``StrOutputParser``) or ``AIMessageChunk``s (ending in a chat model), which join to what `invoke`
        returns; a chain ending otherwise yields `invoke`'s result as its one chunk."""
        kind = stream_kind(self.step)
        if kind is None:
            yield self.invoke(input, config, **kwargs)
            return
        criteria = self.criteria or P.LATENCY
        submit = functools.partial(self.submit, input, config)
        yield from stream_text(self.connection, submit, kind, criteria, self.timeout)

    async def astream(
        self, input: Any, config: RunnableConfig | None = None, **kwargs: Any
    ) -> AsyncIterator[Any]:
        """``async for`` form of `stream`."""
        kind = stream_kind(self.step)
        if kind is None:
            yield await self.ainvoke(input, config, **kwargs)
            return
        criteria = self.criteria or P.LATENCY
        asubmit = functools.partial(self.asubmit, input, config)
        async for chunk in astream_text(self.connection, asubmit, kind, criteria, self.timeout):
            yield chunk

    # ---------------------------------------------------------------------------------------- submit
    def _submit_program(self, value: Any) -> Program:
        sub = Submission(self.criteria or P.LATENCY)
        out = yield from self.step.run(_externals(value), sub)
        return (yield from sub.submit(out))

    def submit(self, inputs: Any, config: RunnableConfig | None = None) -> dict[str, P.Variable]:
        """Queue a run in the current ``with P.Session(...)`` and return its outputs' variables at once.

        ``inputs`` may hold `parrot.Variable`s (outputs of an earlier `submit`): they are bound as
        variables, so a Python loop can chain runs without waiting (a refine summary). Returns one
        variable per key of a dict output, else ``{"output": variable}``; their values are the server's
        (text, or the parsed JSON), before any client-side post-processing (pydantic validation, the
        ``AIMessage`` wrapper) that ``invoke`` applies. A step that must run on the client makes this
        wait for what it needs.
        """
        session = P.current_session()
        (result,) = run_sync(
            [self._submit_program(inputs)],
            timeout=self.timeout,
            invoke=lambda request, _: request.runnable.invoke(request.input, config),
        )
        if isinstance(result, Exception):
            raise result
        assert all(v.session is session for v in result.values())
        return result

    async def asubmit(self, inputs: Any, config: RunnableConfig | None = None) -> dict[str, P.Variable]:
        """`submit` in the current ``async with P.Session(...)``."""
        P.current_session()

        async def ainvoke(request: RunClient, _: int) -> Any:
            return await request.runnable.ainvoke(request.input, config)

        (result,) = await run_async([self._submit_program(inputs)], timeout=self.timeout, ainvoke=ainvoke)
        if isinstance(result, Exception):
            raise result
        return result
