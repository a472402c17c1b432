"""Response synthesizers that submit LlamaIndex's refine chain or summary tree to Parrot as one DAG.

`ParrotRefine`, `ParrotCompactAndRefine` and `ParrotTreeSummarize` are LlamaIndex's `Refine`,
`CompactAndRefine` and `TreeSummarize` (same constructor options, prompts, packing and prompt
customisation through ``update_prompts``) whose ``get_response`` / ``aget_response`` do not call the LLM
step by step. They build the calls LlamaIndex would make — the same templates, the same chunks, the same
order — as unrendered semantic calls in one `parrot.Session`, with each step's output variable feeding the
next: the refine chain's ``existing_answer``, the tree's map summaries (one task group) feeding the
reduce. Then one ``get(criteria=latency)`` of the final answer. The server runs the dependent calls
back to back, without a client round trip between them.

With the same LLM outputs (greedy decoding on the same engine) the answer equals LlamaIndex's. Where a
packing decision depends on an answer's length and the answer could be long enough to change it, the
synthesizer waits for that answer and decides exactly as LlamaIndex does (`llamaindex_parrot.packing`).
Not reproduced: LlamaIndex keeps the previous refine answer when a step answers with the empty string, and
drops empty summaries before a reduce; the DAG passes the empty text on (both need the value to decide).

Options whose control flow runs client code between calls cannot be a DAG and raise
`UnsupportedSynthesisError`: ``output_cls`` and ``structured_answer_filtering`` (each step's JSON is parsed
on the client to decide the next), a ``program_factory``, an output parser on the LLM, ``multimodal``.
With ``streaming=True`` the final answer streams token by token as the server writes it (``synthesize``
gives LlamaIndex's `StreamingResponse`, ``asynthesize`` its `AsyncStreamingResponse`; ``get_response``
a generator): the call returns once the whole DAG is submitted — after any answer a packing decision
waits for, as LlamaIndex runs every call before the last — and the session stays open until the stream
is read to its end, closed, or garbage-collected (`llamaindex_parrot.dag.stream_plan`). The chunks join
to the non-streaming answer, except that an empty answer streams nothing where ``get_response`` says
"Empty Response" for a refine chain (LlamaIndex's streaming does the same). A failed call raises
`parrot.VariableFailedError` from the stream.
"""

from __future__ import annotations

from collections import deque
from collections.abc import AsyncGenerator, Callable, Generator, Sequence
from typing import Any, cast

import llama_index.core.instrumentation as instrument
import parrot as P
from llama_index.core.base.response.schema import RESPONSE_TYPE
from llama_index.core.callbacks.base import CallbackManager
from llama_index.core.indices.prompt_helper import PromptHelper
from llama_index.core.instrumentation.events.synthesis import GetResponseEndEvent, GetResponseStartEvent
from llama_index.core.llms import LLM
from llama_index.core.prompts import BasePromptTemplate
from llama_index.core.prompts.prompt_utils import get_biggest_prompt
from llama_index.core.response.utils import aget_response_text, get_response_text
from llama_index.core.response_synthesizers import CompactAndRefine, Refine, TreeSummarize
from llama_index.core.response_synthesizers.refine import DEFAULT_RESPONSE_PADDING_SIZE
from llama_index.core.schema import NodeWithScore, QueryType
from llama_index.core.settings import Settings
from llama_index.core.types import RESPONSE_TEXT_TYPE

from llamaindex_parrot.dag import Plan, arun_plan, astream_plan, run_plan, stream_plan
from llamaindex_parrot.errors import EmptyNodesError, UnsupportedSynthesisError
from llamaindex_parrot.llm import ParrotLLM
from llamaindex_parrot.packing import default_answer_budget, fits_with_answer, joined_fits
from llamaindex_parrot.unrendered import Value

__all__ = ["ParrotCompactAndRefine", "ParrotRefine", "ParrotTreeSummarize"]

dispatcher = instrument.get_dispatcher(__name__)

# What LlamaIndex's `PromptHelper.repack` puts between the texts it packs into one chunk.
SEPARATOR = "\n\n"
EMPTY_RESPONSE = "Empty Response"  # LlamaIndex's text for "no answer"


def require_parrot_llm(llm: LLM | None, who: str) -> ParrotLLM:
    """The synthesizer's LLM: ``llm``, else ``Settings.llm`` if one was set; it must be a `ParrotLLM`."""
    llm = llm if llm is not None else Settings._llm
    if not isinstance(llm, ParrotLLM):
        got = "no llm (and Settings.llm is not set)" if llm is None else type(llm).__name__
        raise TypeError(f"{who} submits its calls to a Parrot server: pass llm=ParrotLLM(url), got {got}")
    if llm.output_parser is not None:
        raise UnsupportedSynthesisError(
            f"{who} cannot apply the LLM's output parser between calls (it runs on the client): "
            "remove llm.output_parser, or use LlamaIndex's own synthesizer"
        )
    return llm


def _reject(who: str, **options: Any) -> None:
    """Raise `UnsupportedSynthesisError` for the first option set to a value that needs client code."""
    reasons = {
        "output_cls": "each step's answer is parsed into output_cls on the client",
        "structured_answer_filtering": "each step's JSON decides on the client whether the answer changes",
        "program_factory": "a program runs client code around each call",
        "multimodal": "multimodal synthesis needs a chat model and message chunks",
    }
    for name, value in options.items():
        if value:
            raise UnsupportedSynthesisError(
                f"{who} does not support {name}={value!r} ({reasons[name]}), which cannot run inside a "
                "server-side DAG; use LlamaIndex's own synthesizer with ParrotLLM for it"
            )


class _DagSynthesis:
    """What the Parrot synthesizers share: the LLM, the answer budget, empty input, running the plan.

    A mixin placed before the LlamaIndex synthesizer class (its ``synthesize`` runs first).
    """

    _llm: LLM  # a `ParrotLLM` (`require_parrot_llm`): `_parrot`
    _streaming: bool
    _answer_budget: int
    _empty_response_given: bool

    @property
    def _parrot(self) -> ParrotLLM:
        """The LLM, which the constructors took only as a `ParrotLLM`."""
        return cast(ParrotLLM, self._llm)

    def _setup_dag(self, answer_token_budget: int | None, empty_response: str | None) -> None:
        if answer_token_budget is not None and answer_token_budget < 0:
            raise ValueError(f"answer_token_budget must be >= 0 tokens, got {answer_token_budget}")
        self._answer_budget = (
            default_answer_budget(self._parrot.max_tokens)
            if answer_token_budget is None
            else answer_token_budget
        )
        self._empty_response_given = empty_response is not None
        if empty_response is not None:
            self._empty_response = empty_response  # BaseSynthesizer's attribute: what `synthesize` answers

    def _check_nodes(self, nodes: Sequence[NodeWithScore]) -> None:
        if not nodes and not self._empty_response_given:
            raise EmptyNodesError(
                f"{type(self).__name__} got no nodes to answer from (the retriever found nothing?): check "
                "the index and the query, or pass empty_response='...' to answer with a fixed text instead"
            )

    def _check_chunks(self, text_chunks: Sequence[str]) -> list[str]:
        who = type(self).__name__
        if isinstance(text_chunks, str):
            raise TypeError(f"{who}: text_chunks is a list of texts, got one str; wrap it as [text]")
        if not text_chunks:
            raise EmptyNodesError(f"{who} got no text chunks to answer from: pass at least one")
        return list(text_chunks)

    def synthesize(
        self,
        query: QueryType,
        nodes: list[NodeWithScore],
        additional_source_nodes: Sequence[NodeWithScore] | None = None,
        **response_kwargs: Any,
    ) -> RESPONSE_TYPE:
        """LlamaIndex's ``synthesize``; no nodes raise `EmptyNodesError` unless ``empty_response`` was set."""
        self._check_nodes(nodes)
        return super().synthesize(query, nodes, additional_source_nodes, **response_kwargs)  # type: ignore[misc]

    async def asynthesize(
        self,
        query: QueryType,
        nodes: list[NodeWithScore],
        additional_source_nodes: Sequence[NodeWithScore] | None = None,
        **response_kwargs: Any,
    ) -> RESPONSE_TYPE:
        """``async`` form of `synthesize`."""
        self._check_nodes(nodes)
        return await super().asynthesize(query, nodes, additional_source_nodes, **response_kwargs)  # type: ignore[misc]

    def _answer(self, make_plan: Callable[[], Plan], empty: str) -> RESPONSE_TEXT_TYPE:
        """The plan's answer: its text (``empty`` for none), or with ``streaming`` a generator of its
        chunks (LlamaIndex streams whatever the last call writes, so no ``empty`` there)."""
        if self._streaming:
            return stream_plan(self._parrot, make_plan)
        return run_plan(self._parrot, make_plan) or empty

    async def _aanswer(self, make_plan: Callable[[], Plan], empty: str) -> RESPONSE_TEXT_TYPE:
        """``async`` form of `_answer` (an async generator when streaming)."""
        if self._streaming:
            return await astream_plan(self._parrot, make_plan)
        return await arun_plan(self._parrot, make_plan) or empty

    def _submit(
        self, template: BasePromptTemplate, values: dict[str, Value], strip: bool = False
    ) -> P.Variable:
        """Queue one call of ``template`` with ``values`` in the current session; its output variable."""
        call = self._parrot.unrendered_call(template, values)
        transforms = (P.transforms.strip(),) if strip else ()
        return call.submit(self._parrot.sampling(), model=self._parrot.model, transforms=transforms)


class ParrotRefine(_DagSynthesis, Refine):
    """LlamaIndex's `Refine`, submitted as one chain: each refine step's ``existing_answer`` is the
    previous step's output variable, and the last answer is fetched with one ``get``.

    Takes `Refine`'s options (``text_qa_template``, ``refine_template``, ``prompt_helper``,
    ``response_padding_size``, ``streaming``, ``verbose``, ...) plus ``answer_token_budget`` (see
    `llamaindex_parrot.packing`; default three prompt-helper tokens per ``llm.max_tokens``) and
    ``empty_response`` (the answer for no nodes; without it, no nodes raise `EmptyNodesError`). The prompt
    helper defaults to ``Settings``'s, else ``llm.prompt_helper()``.
    """

    def __init__(
        self,
        llm: LLM | None = None,
        callback_manager: CallbackManager | None = None,
        prompt_helper: PromptHelper | None = None,
        text_qa_template: BasePromptTemplate | None = None,
        refine_template: BasePromptTemplate | None = None,
        response_padding_size: int = DEFAULT_RESPONSE_PADDING_SIZE,
        streaming: bool = False,
        verbose: bool = False,
        answer_token_budget: int | None = None,
        empty_response: str | None = None,
        output_cls: type | None = None,
        structured_answer_filtering: bool = False,
        program_factory: Any = None,
        multimodal: bool = False,
    ) -> None:
        who = type(self).__name__
        _reject(
            who,
            output_cls=output_cls,
            structured_answer_filtering=structured_answer_filtering,
            program_factory=program_factory,
            multimodal=multimodal,
        )
        parrot_llm = require_parrot_llm(llm, who)
        super().__init__(
            llm=parrot_llm,
            callback_manager=callback_manager,
            prompt_helper=prompt_helper or Settings._prompt_helper or parrot_llm.prompt_helper(),
            text_qa_template=text_qa_template,
            refine_template=refine_template,
            response_padding_size=response_padding_size,
            streaming=streaming,
            verbose=verbose,
        )
        self._setup_dag(answer_token_budget, empty_response)

    @dispatcher.span
    def get_response(
        self,
        query_str: str,
        text_chunks: Sequence[str],
        prev_response: RESPONSE_TEXT_TYPE | None = None,
        **response_kwargs: Any,
    ) -> RESPONSE_TEXT_TYPE:
        """The refined answer over ``text_chunks``: the whole chain submitted, then one ``get`` (with
        ``streaming``, a generator of the answer's chunks)."""
        chunks = self._check_chunks(text_chunks)
        if isinstance(prev_response, Generator):
            prev_response = get_response_text(prev_response)
        dispatcher.event(GetResponseStartEvent(query_str=query_str, text_chunks=chunks))
        answer = self._answer(
            lambda: self._plan(query_str, chunks, prev_response, response_kwargs), EMPTY_RESPONSE
        )
        dispatcher.event(GetResponseEndEvent())
        return answer

    @dispatcher.span
    async def aget_response(
        self,
        query_str: str,
        text_chunks: Sequence[str],
        prev_response: RESPONSE_TEXT_TYPE | None = None,
        **response_kwargs: Any,
    ) -> RESPONSE_TEXT_TYPE:
        """``async`` form of `get_response`."""
        chunks = self._check_chunks(text_chunks)
        if isinstance(prev_response, AsyncGenerator):
            prev_response = await aget_response_text(prev_response)
        elif isinstance(prev_response, Generator):
            prev_response = get_response_text(prev_response)
        dispatcher.event(GetResponseStartEvent(query_str=query_str, text_chunks=chunks))
        answer = await self._aanswer(
            lambda: self._plan(query_str, chunks, prev_response, response_kwargs), EMPTY_RESPONSE
        )
        dispatcher.event(GetResponseEndEvent())
        return answer

    def _plan(
        self, query_str: str, chunks: list[str], prev_response: Any, response_kwargs: dict[str, Any]
    ) -> Plan:
        """`Refine._run_refine_loop` with variables for answers: the same repacking, prompts and order."""
        llm, helper = self._parrot, self._prompt_helper
        qa, refine = self._text_qa_template, self._refine_template
        max_prompt = get_biggest_prompt([qa, refine])
        pending = deque(
            piece
            for chunk in chunks
            for piece in helper.repack(max_prompt, [chunk], llm=llm, padding=self._response_padding_size)
        )
        response: P.Variable | str | None = prev_response
        while pending:
            chunk = pending.popleft()
            if response is None:
                response = self._submit(qa, {"query_str": query_str, "context_str": chunk, **response_kwargs})
                continue
            if isinstance(response, P.Variable) and not self._fits(query_str, chunk):
                response = yield response  # its length decides how LlamaIndex repacks this chunk
            if isinstance(response, str):
                with_answer = refine.partial_format(query_str=query_str, existing_answer=response)
                repacked = helper.repack(with_answer, [chunk], llm=llm)
                if len(repacked) > 1:
                    pending.extendleft(repacked)  # as LlamaIndex does (extendleft reverses them, there too)
                    continue
                chunk = repacked[0]
            values = {"query_str": query_str, "existing_answer": response, "context_msg": chunk}
            response = self._submit(refine, {**values, **response_kwargs})
        return response

    def _fits(self, query_str: str, chunk: str) -> bool:
        """Whether LlamaIndex keeps ``chunk`` whole next to any answer within the budget."""
        empty = self._refine_template.partial_format(query_str=query_str, existing_answer="")
        return fits_with_answer(self._prompt_helper, empty, chunk, self._llm, self._answer_budget)


class ParrotCompactAndRefine(CompactAndRefine, ParrotRefine):
    """LlamaIndex's `CompactAndRefine` (response mode "compact", LlamaIndex's default): the chunks packed
    as densely as the prompt allows, then `ParrotRefine`'s single-submission chain over them."""

    # Checked before compaction: LlamaIndex's repack turns no chunks into one empty chunk.
    def get_response(
        self,
        query_str: str,
        text_chunks: Sequence[str],
        prev_response: RESPONSE_TEXT_TYPE | None = None,
        **response_kwargs: Any,
    ) -> RESPONSE_TEXT_TYPE:
        """`ParrotRefine.get_response` over the compacted chunks."""
        chunks = self._check_chunks(text_chunks)
        return super().get_response(query_str, chunks, prev_response, **response_kwargs)

    async def aget_response(
        self,
        query_str: str,
        text_chunks: Sequence[str],
        prev_response: RESPONSE_TEXT_TYPE | None = None,
        **response_kwargs: Any,
    ) -> RESPONSE_TEXT_TYPE:
        """``async`` form of `get_response`."""
        chunks = self._check_chunks(text_chunks)
        return await super().aget_response(query_str, chunks, prev_response, **response_kwargs)


class ParrotTreeSummarize(_DagSynthesis, TreeSummarize):
    """LlamaIndex's `TreeSummarize`, submitted as one map-reduce DAG: a summary call per packed chunk
    (one task group on the server, outputs stripped as LlamaIndex's repack strips them) feeding the reduce
    call through variables, and one ``get`` of the reduce.

    Takes `TreeSummarize`'s options (``summary_template``, ``prompt_helper``, ``streaming``, ``verbose``;
    ``use_async`` is accepted and has no effect: the server runs the map calls in parallel anyway) plus
    ``answer_token_budget`` and ``empty_response`` as `ParrotRefine`. When the map summaries might not fit
    one reduce prompt (``packing.joined_fits``), the synthesizer gets them and continues level by level
    exactly as LlamaIndex does.
    """

    def __init__(
        self,
        llm: LLM | None = None,
        callback_manager: CallbackManager | None = None,
        prompt_helper: PromptHelper | None = None,
        summary_template: BasePromptTemplate | None = None,
        streaming: bool = False,
        use_async: bool = False,
        verbose: bool = False,
        answer_token_budget: int | None = None,
        empty_response: str | None = None,
        output_cls: type | None = None,
        multimodal: bool = False,
    ) -> None:
        who = type(self).__name__
        _reject(who, output_cls=output_cls, multimodal=multimodal)
        parrot_llm = require_parrot_llm(llm, who)
        super().__init__(
            llm=parrot_llm,
            callback_manager=callback_manager,
            prompt_helper=prompt_helper or Settings._prompt_helper or parrot_llm.prompt_helper(),
            summary_template=summary_template,
            streaming=streaming,
            use_async=use_async,
            verbose=verbose,
        )
        self._setup_dag(answer_token_budget, empty_response)

    @dispatcher.span
    def get_response(
        self, query_str: str, text_chunks: Sequence[str], **response_kwargs: Any
    ) -> RESPONSE_TEXT_TYPE:
        """The tree-summarized answer: every level's calls submitted at once, then one ``get`` (with
        ``streaming``, a generator of the answer's chunks)."""
        chunks = self._check_chunks(text_chunks)
        return self._answer(lambda: self._plan(query_str, chunks, response_kwargs), "")

    @dispatcher.span
    async def aget_response(
        self, query_str: str, text_chunks: Sequence[str], **response_kwargs: Any
    ) -> RESPONSE_TEXT_TYPE:
        """``async`` form of `get_response`."""
        chunks = self._check_chunks(text_chunks)
        return await self._aanswer(lambda: self._plan(query_str, chunks, response_kwargs), "")

    def _plan(self, query_str: str, chunks: list[str], response_kwargs: dict[str, Any]) -> Plan:
        """`TreeSummarize.get_response` with variables for summaries: the same repacking and prompts."""
        summary = self._summary_template.partial_format(query_str=query_str)
        packed = self._prompt_helper.repack(summary, text_chunks=chunks, llm=self._llm)
        if self._verbose:
            print(f"{len(packed)} text chunks after repacking")
        if len(packed) == 1:
            return self._submit(summary, {"context_str": packed[0], **response_kwargs})
        # Stripped as LlamaIndex's repack strips them; only ever a reduce's input, never the final answer,
        # whose text (what a stream gives) is therefore its value.
        summaries = [self._submit(summary, {"context_str": c, **response_kwargs}, strip=True) for c in packed]
        if joined_fits(
            self._prompt_helper, summary, len(summaries), SEPARATOR, self._llm, self._answer_budget
        ):
            joined: list[P.Variable | str] = []
            for s in summaries:
                joined += [SEPARATOR, s] if joined else [s]
            return self._submit(summary, {"context_str": joined, **response_kwargs})
        # The summaries may need more than one reduce call: how many depends on their lengths.
        texts = []
        for s in summaries:
            texts.append((yield s))
        return (yield from self._plan(query_str, texts, response_kwargs))
