"""LlamaIndex on Parrot serve: a swap-in LLM that sends prompt templates unrendered, and response
synthesizers that submit a whole refine chain or summary tree as one DAG.

```python
from llama_index.core import Document, SummaryIndex
from llamaindex_parrot import ParrotLLM, ParrotTreeSummarize

llm = ParrotLLM("http://127.0.0.1:9000", max_tokens=128)
index = SummaryIndex.from_documents([Document(text=...)])
engine = index.as_query_engine(llm=llm, response_synthesizer=ParrotTreeSummarize(llm=llm))
print(engine.query("What is it about?"))
```

`ParrotLLM` also works with any LlamaIndex component (``index.as_query_engine(llm=llm,
response_mode=...)``): each ``predict`` is one semantic call. `get_response_synthesizer` picks the Parrot
synthesizer for "refine", "compact" and "tree_summarize".
"""

from parrot.extras import require_extra

require_extra("llama_index.core", "llamaindex_parrot", "llamaindex")  # before anything imports it

from llamaindex_parrot.errors import (
    EmptyNodesError,
    MissingTemplateVariableError,
    ParrotLlamaIndexError,
    PromptConversionError,
    UnsupportedSynthesisError,
)
from llamaindex_parrot.factory import get_response_synthesizer
from llamaindex_parrot.llm import ParrotLLM
from llamaindex_parrot.synthesizers import ParrotCompactAndRefine, ParrotRefine, ParrotTreeSummarize
from llamaindex_parrot.tokenizer import load_tokenizer

__all__ = [
    "EmptyNodesError",
    "MissingTemplateVariableError",
    "ParrotCompactAndRefine",
    "ParrotLLM",
    "ParrotLlamaIndexError",
    "ParrotRefine",
    "ParrotTreeSummarize",
    "PromptConversionError",
    "UnsupportedSynthesisError",
    "get_response_synthesizer",
    "load_tokenizer",
]
