"""A token counter from a Hugging Face ``tokenizer.json``, for LlamaIndex's prompt packing.

LlamaIndex decides how many chunks fit in a prompt by counting tokens (`PromptHelper`, the node
splitters); by default it counts with tiktoken's GPT-3.5 encoding. Counting with the engine's own
tokenizer makes those decisions match what the server will actually fill. `ParrotLLM(tokenizer="server")`
asks the server itself (``POST /tokenize``, one request per new text); this reads the model's own file
instead, with no request at all (for the embedded "tiny" model: ``server.engine.tiny.TOKENIZER_DIR``).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

__all__ = ["load_tokenizer"]


def load_tokenizer(path: str | Path) -> Callable[[str], list[int]]:
    """``text -> token ids`` (no special tokens) from a ``tokenizer.json`` file or a folder holding one.

    Needs the ``tokenizers`` package (a dependency of the server extra). Raises `FileNotFoundError` for a
    missing file.
    """
    file = Path(path)
    if file.is_dir():
        file = file / "tokenizer.json"
    if not file.is_file():
        raise FileNotFoundError(f"no tokenizer file at {file}: give a tokenizer.json or the model folder")
    try:
        from tokenizers import Tokenizer
    except ImportError as e:  # pragma: no cover - tokenizers ships with the server extra
        raise ImportError("load_tokenizer needs the `tokenizers` package: pip install tokenizers") from e
    tokenizer = Tokenizer.from_file(str(file))

    def encode(text: str) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=False).ids)

    return encode
