"""The embedded ``"tiny"`` default model: a small LLaMA with deterministic weights and a shipped tokenizer.

The tokenizer files in this folder are built offline by ``python -m server.engine.tiny.build_tokenizer``.
"""

import pathlib

TOKENIZER_DIR: pathlib.Path = pathlib.Path(__file__).parent
