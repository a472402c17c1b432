"""LangChain integration of Parrot serve: swap-in models and `compile_chain`.

* `ChatParrot` and `ParrotLLM` are LangChain models on a Parrot server's OpenAI-compatible endpoints:
  change one import and a chain runs on Parrot, request by request.
* `compile_chain(chain)` turns the chain's ``prompt -> model -> parser`` runs into semantic function
  calls with server-side transforms, so the whole chain reaches the server as one submission and values
  flow between its steps as semantic variables, never through the client.

```python
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import ChatPromptTemplate
from langchain_parrot import ChatParrot, compile_chain

chat = ChatParrot(base_url="http://127.0.0.1:9000")  # chat template: the one the server publishes
prompt = ChatPromptTemplate.from_messages([("system", "You are terse."), ("human", "Summarize: {text}")])
chain = compile_chain(prompt | chat | StrOutputParser())
chain.invoke({"text": "..."})
```
"""

from parrot.extras import require_extra

require_extra("langchain_core", "langchain_parrot", "langchain")  # before anything imports it

from langchain_parrot.chat_format import TINY_MODEL_DIR, ChatFormat
from langchain_parrot.chat_models import ChatParrot
from langchain_parrot.compile import CompiledChain, compile_chain
from langchain_parrot.errors import (
    ClientSideStepWarning,
    CompileError,
    MissingVariableError,
    ParrotLangChainError,
    ServerParserError,
    UnsupportedInputError,
    UnsupportedParserError,
)
from langchain_parrot.llms import ParrotLLM

__all__ = [
    "TINY_MODEL_DIR",
    "ChatFormat",
    "ChatParrot",
    "ClientSideStepWarning",
    "CompileError",
    "CompiledChain",
    "MissingVariableError",
    "ParrotLLM",
    "ParrotLangChainError",
    "ServerParserError",
    "UnsupportedInputError",
    "UnsupportedParserError",
    "compile_chain",
]

__version__ = "0.1.0"
