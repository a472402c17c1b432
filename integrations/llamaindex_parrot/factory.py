"""`get_response_synthesizer`: LlamaIndex's factory of the same name, with Parrot's DAG synthesizers.

Response modes "refine", "compact" and "tree_summarize" give `ParrotRefine`, `ParrotCompactAndRefine` and
`ParrotTreeSummarize` (one submission per query); every other mode ("simple_summarize", "accumulate",
"generation", ...) gives LlamaIndex's own synthesizer driving the `ParrotLLM` call by call, each call
still an unrendered semantic call. Use the result as ``index.as_query_engine(response_synthesizer=...)``
or ``RetrieverQueryEngine(retriever, response_synthesizer=...)``.
"""

from __future__ import annotations

from typing import Any

from llama_index.core.callbacks.base import CallbackManager
from llama_index.core.indices.prompt_helper import PromptHelper
from llama_index.core.llms import LLM
from llama_index.core.prompts import BasePromptTemplate
from llama_index.core.response_synthesizers import (
    BaseSynthesizer,
    ResponseMode,
    get_response_synthesizer as llamaindex_synthesizer,
)
from llama_index.core.settings import Settings

from llamaindex_parrot.synthesizers import (
    ParrotCompactAndRefine,
    ParrotRefine,
    ParrotTreeSummarize,
    require_parrot_llm,
)

__all__ = ["get_response_synthesizer"]


def get_response_synthesizer(
    llm: LLM | None = None,
    response_mode: ResponseMode | str = ResponseMode.COMPACT,
    *,
    prompt_helper: PromptHelper | None = None,
    text_qa_template: BasePromptTemplate | None = None,
    refine_template: BasePromptTemplate | None = None,
    summary_template: BasePromptTemplate | None = None,
    callback_manager: CallbackManager | None = None,
    streaming: bool = False,
    verbose: bool = False,
    answer_token_budget: int | None = None,
    **llamaindex_options: Any,
) -> BaseSynthesizer:
    """A response synthesizer for ``response_mode`` on a `ParrotLLM` (``llm`` or ``Settings.llm``).

    The prompt helper defaults to ``Settings``'s, else ``llm.prompt_helper()`` (counting with the LLM's
    tokenizer), for the Parrot synthesizers and LlamaIndex's alike. ``answer_token_budget`` applies to the
    Parrot ones; ``llamaindex_options`` (``use_async``, ``output_cls``, ``simple_template``, ...) go to
    the synthesizer they belong to — options the Parrot synthesizers cannot honour raise
    `UnsupportedSynthesisError` there.
    """
    mode = ResponseMode(response_mode)
    parrot_llm = require_parrot_llm(llm, f"get_response_synthesizer(response_mode={mode.value!r})")
    helper = prompt_helper or Settings._prompt_helper or parrot_llm.prompt_helper()
    common: dict[str, Any] = {
        "llm": parrot_llm,
        "callback_manager": callback_manager,
        "prompt_helper": helper,
        "streaming": streaming,
        "verbose": verbose,
    }
    if mode in (ResponseMode.REFINE, ResponseMode.COMPACT):
        cls = ParrotRefine if mode == ResponseMode.REFINE else ParrotCompactAndRefine
        return cls(
            **common,
            text_qa_template=text_qa_template,
            refine_template=refine_template,
            answer_token_budget=answer_token_budget,
            **llamaindex_options,
        )
    if mode == ResponseMode.TREE_SUMMARIZE:
        return ParrotTreeSummarize(
            **common,
            summary_template=summary_template,
            answer_token_budget=answer_token_budget,
            **llamaindex_options,
        )
    return llamaindex_synthesizer(
        response_mode=mode,
        text_qa_template=text_qa_template,
        refine_template=refine_template,
        summary_template=summary_template,
        **common,
        **llamaindex_options,
    )
