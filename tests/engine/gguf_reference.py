"""References for the GGUF tests: transformers' own loading of a GGUF file and its greedy tokens."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from server.common.settings import CACHE_DIR

_HF_GGUF: dict[Path, Any] = {}


@pytest.fixture(autouse=True)
def private_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Converted tokenizers go to a per-session folder, not the user's cache (autouse where imported)."""
    monkeypatch.setenv(CACHE_DIR.name, str(tmp_path_factory.getbasetemp() / "parrot-cache"))


def hf_gguf_model(path: Path) -> Any:
    """transformers' own loading of a GGUF file (dequantized to fp32)."""
    from transformers import AutoModelForCausalLM

    if path not in _HF_GGUF:
        _HF_GGUF[path] = AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32
        ).eval()
    return _HF_GGUF[path]


def hf_greedy(model: Any, prompt: list[int], max_new_tokens: int, eos: int | None = None) -> list[int]:
    """Greedy tokens of a transformers model: EOS ignored unless given (then it stops there)."""
    stop = {} if eos is None else {"eos_token_id": eos}
    limits = {"min_new_tokens": max_new_tokens} if eos is None else {}
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=2,
            **stop,
            **limits,
        )
    return out[0, len(prompt) :].tolist()
