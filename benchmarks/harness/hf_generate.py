"""Hugging Face ``generate`` as a system of an engine-level comparison, on our engine's very weights.

`load_baseline` finds (or writes) a Hugging Face folder of the weights our engine loaded (`hf_folder`) and
loads ``LlamaForCausalLM`` on it in our engine's dtype, refusing any weight HF would initialise at random
(`load_hf`); `HFGenerate` is what an HF user runs over a batch: ``generate`` on the left-padded prompts.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from benchmarks.harness.engine_models import export_hf_folder
from benchmarks.harness.generators import Outputs
from benchmarks.harness.output import log
from server.engine import LLMEngine
from server.engine.compute_thread import on_own_thread

__all__ = ["HFGenerate", "hf_folder", "left_pad", "load_baseline", "load_hf", "pad_token_id"]


class HFGenerate:
    """What a Hugging Face user runs: ``generate`` over a left-padded batch with an attention mask."""

    name = "hf"

    def __init__(self, model: Any, pad_token_id: int) -> None:
        self.model = model
        self.pad_token_id = pad_token_id

    def run(self, prompts: Sequence[list[int]], max_new_tokens: int) -> tuple[float, Outputs]:
        input_ids, mask = left_pad(prompts, self.pad_token_id)
        device = next(self.model.parameters()).device
        input_ids, mask = input_ids.to(device), mask.to(device)

        def generate() -> tuple[float, Outputs]:
            start = time.perf_counter()
            with torch.inference_mode():
                out = self.model.generate(
                    input_ids,
                    attention_mask=mask,
                    max_new_tokens=max_new_tokens,
                    min_new_tokens=max_new_tokens,  # as our ignore_eos: every request makes N tokens
                    do_sample=False,
                    pad_token_id=self.pad_token_id,
                )
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
            return time.perf_counter() - start, out[:, input_ids.shape[1] :].tolist()

        # On a thread that ends, as our engine loads: a thread pool left on this long-lived thread would slow
        # our engine's thread (`server.engine.compute_thread`).
        return on_own_thread(generate, "hf-generate")


def left_pad(prompts: Sequence[list[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and attention mask of a left-padded batch (how decoder-only models are batched in HF)."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p) :] = 1
    return ids, mask


def pad_token_id(tokenizer: Any, hf_model: Any) -> int:
    """A token to pad with (masked out, so any id works; prefer the model's own pad token)."""
    for candidate in (
        getattr(tokenizer, "pad_token_id", None),
        getattr(hf_model.config, "pad_token_id", None),
        getattr(tokenizer, "eos_token_id", None),
    ):
        if isinstance(candidate, int):
            return candidate
    return 0


def hf_folder(model: str, engine: LLMEngine, workdir: Path, seed: int) -> Path:
    """A Hugging Face folder holding the weights our engine loaded, for the baselines to load.

    ``model`` a folder: that folder. ``tiny``: the embedded model written out (the same deterministic
    weights: ``EngineConfig.seed`` is ``save_tiny``'s seed). Anything else (a GGUF file, a model name): the
    engine's loaded weights exported to ``workdir`` — only then, since a folder needs no copy.
    """
    if model == "tiny":
        from server.engine.tiny.model import save_tiny

        return save_tiny(workdir / "tiny", seed=seed)
    if Path(model).is_dir():
        return Path(model)
    log(f"{model} is not a Hugging Face folder: exporting the engine's weights for HF and vLLM ...")
    return export_hf_folder(engine, workdir / "hf-export")


def load_hf(folder: Path, dtype: torch.dtype) -> Any:
    """``LlamaForCausalLM.from_pretrained(folder)`` in ``dtype``; every weight must come from the folder."""
    from transformers import LlamaForCausalLM

    hf, info = LlamaForCausalLM.from_pretrained(str(folder), dtype=dtype, output_loading_info=True)
    if info.get("missing_keys"):
        # A weight HF initialised at random would make the comparison meaningless: refuse.
        raise ValueError(f"HF found no weights for {sorted(info['missing_keys'])[:5]} in {folder}")
    return hf.eval()


def load_baseline(model: str, engine: LLMEngine, workdir: Path) -> tuple[Path, Any]:
    """The HF folder of our engine's weights (`hf_folder`) and HF's model on it, in our engine's dtype."""
    import transformers

    # Quiet: the weight-loading progress bar and the over-long-sequence warning of workload tokenizers.
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()

    def export_and_load() -> tuple[Path, Any]:
        folder = hf_folder(model, engine, workdir, engine.config.seed)
        return folder, load_hf(folder, engine.config.torch_dtype())

    # On a thread that ends, as our engine loads (`server.engine.compute_thread`).
    return on_own_thread(export_and_load, "hf-load")
