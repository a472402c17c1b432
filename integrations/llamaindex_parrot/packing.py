"""When a synthesizer's packing decision does not depend on an answer the server has not produced yet.

LlamaIndex's Refine repacks each chunk against the refine prompt *holding the previous answer*, and
TreeSummarize repacks the map summaries *by their length* before the reduce. Submitting the whole DAG at
once needs those decisions before the answers exist. An answer is at most ``max_tokens`` engine tokens,
so it is at most some ``answer_budget`` tokens as the prompt helper counts them: when a chunk fits next to
an answer of that size, LlamaIndex's repack keeps it whole for any real answer, and the step joins the DAG;
when it might not, the synthesizer waits for the answer and repacks exactly as LlamaIndex does.

The budget defaults to three counted tokens per generated token (`default_answer_budget`): re-encoding
decoded text with a byte-level BPE tokenizer costs at most three tokens per generated token in practice —
a byte token that decodes to U+FFFD re-encodes as its three UTF-8 bytes. When the prompt helper counts
with another tokenizer than the engine's, pass a budget that bounds the answers in its tokens.
"""

from __future__ import annotations

from llama_index.core.indices.prompt_helper import PromptHelper
from llama_index.core.llms import LLM
from llama_index.core.prompts import BasePromptTemplate

__all__ = ["count_tokens", "default_answer_budget", "fits_with_answer", "joined_fits"]

# Tokens that tokenizing a concatenation may add at each boundary between its parts (a merge that no
# longer happens across the boundary).
BOUNDARY_TOKENS = 4


def default_answer_budget(max_tokens: int) -> int:
    """Prompt-helper tokens assumed for one answer of at most ``max_tokens`` generated tokens."""
    return 3 * max_tokens


def count_tokens(prompt_helper: PromptHelper, text: str) -> int:
    """``text``'s length in the prompt helper's tokens (the counter its repack decisions use)."""
    # PromptHelper exposes no public counter; its TokenCounter is what `repack` measures prompts with.
    return int(prompt_helper._token_counter.get_string_tokens(text))


def _chunk_size(prompt_helper: PromptHelper, prompt: BasePromptTemplate, llm: LLM) -> int:
    """The chunk size `PromptHelper.repack` uses for ``prompt`` (default padding), or 0 when none fits."""
    try:
        return prompt_helper.get_text_splitter_given_prompt(prompt, llm=llm).chunk_size
    except ValueError:  # LlamaIndex's "chunk size is not positive"
        return 0


def fits_with_answer(
    prompt_helper: PromptHelper,
    empty_answer_prompt: BasePromptTemplate,
    chunk: str,
    llm: LLM,
    answer_budget: int,
) -> bool:
    """Whether ``chunk`` stays one chunk when repacked against the prompt holding any answer of at most
    ``answer_budget`` tokens; ``empty_answer_prompt`` is that prompt holding an empty answer.

    LlamaIndex's repack keeps a (stripped) chunk whole when its tokens are within the chunk size; an answer
    of n tokens lowers the chunk size by at most n plus the boundary tokens around it.
    """
    room = _chunk_size(prompt_helper, empty_answer_prompt, llm) - answer_budget - 2 * BOUNDARY_TOKENS
    return count_tokens(prompt_helper, chunk) <= room


def joined_fits(
    prompt_helper: PromptHelper,
    prompt: BasePromptTemplate,
    parts: int,
    separator: str,
    llm: LLM,
    answer_budget: int,
) -> bool:
    """Whether ``parts`` answers of at most ``answer_budget`` tokens, joined by ``separator``, are one
    chunk for ``prompt`` (TreeSummarize's next level is then a single reduce call)."""
    size = _chunk_size(prompt_helper, prompt, llm)
    per_boundary = count_tokens(prompt_helper, separator) + 2 * BOUNDARY_TOKENS
    return parts * answer_budget + (parts - 1) * per_boundary <= size
