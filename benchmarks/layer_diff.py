"""Where our tokens part from Hugging Face's: every layer's attention and MLP output, ours against HF's in
float32 on the same weights (float64 when ours runs float32), in a prompt's fill and in the decode steps
after it, beside HF's own error in the same dtype (HF run in that dtype against that reference): the
yardstick of what the dtype alone costs.

A random-weight model of a real shape (`benchmarks.harness.random_models`) on ``--device``: our engine fills
one prompt and generates ``--new`` tokens greedily, eager (a captured CUDA graph replays the eager step's
kernels, and no module hook fires inside it); HF then runs prompt + generated tokens in one forward, in
``--dtype`` and in the reference dtype. Each sublayer's error is ``|x - ref| / |ref|`` over its rows (the
fill's prompt rows; each decode step's one row). Errors carry over from the layers below, in HF's run
as in ours, so the ratio ours / HF's own is what a layer adds: the first layer where it jumps names the op
that rounds differently (on CUDA: the Triton layer ops, FlashAttention's varlen fill, the paged decode
kernel, bf16 accumulation in the linears).

    python -m benchmarks.layer_diff [--shape S] [--device D] [--dtype D] [--prompt-len N] [--new N]
        [--ratio R] [--json PATH]

Last line: ``RESULT layer_diff fill_ratio_max=... decode_ratio_max=... first_over_layer=...`` (-1: none).
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
from collections import defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks.harness import random_models
from benchmarks.harness.engine_models import engine_model
from benchmarks.harness.output import markdown_table
from server.engine import EngineConfig, SamplingParams

SUBLAYERS = ("attn", "mlp")
Records = dict[tuple[int, str], list[torch.Tensor]]  # (layer, sublayer) -> outputs, one per call


@dataclass(frozen=True)
class LayerError:
    layer: int
    sublayer: str
    phase: str  # "fill" or "decode"
    ours: float  # |ours - HF ref| / |HF ref|
    hf_own: float  # |HF in our dtype - HF ref| / |HF ref|

    @property
    def ratio(self) -> float:
        return self.ours / self.hf_own if self.hf_own > 0 else (1.0 if self.ours == 0 else float("inf"))


def _hook(records: Records, key: tuple[int, str]) -> Callable[..., None]:
    def record(_module: Any, _inputs: Any, output: Any) -> None:
        out = output[0] if isinstance(output, tuple) else output
        records[key].append(out.detach().reshape(-1, out.shape[-1]).double().cpu())

    return record


def _hooked(layers: Any, attn: str, records: Records) -> list[Any]:
    """Hooks on each layer's attention (module attribute ``attn``) and MLP outputs."""
    handles = []
    for i, layer in enumerate(layers):
        handles.append(getattr(layer, attn).register_forward_hook(_hook(records, (i, "attn"))))
        handles.append(layer.mlp.register_forward_hook(_hook(records, (i, "mlp"))))
    return handles


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x - ref).norm() / ref.norm().clamp_min(1e-30))


async def _ours(engine: Any, prompt: list[int], new: int) -> list[int]:
    await engine.fill(1, prompt)
    result = await engine.generate(1, SamplingParams(max_tokens=new, ignore_eos=True))
    await engine.free_context(1)
    return list(result.token_ids)


def measure(
    shape: str, device: str, dtype: str, prompt_len: int, new: int, seed: int = 0
) -> list[LayerError]:
    """Every (layer, sublayer, phase)'s error, ours and HF's own (module doc)."""
    if prompt_len > EngineConfig.max_num_batched_tokens:
        raise ValueError(f"--prompt-len at most {EngineConfig.max_num_batched_tokens}: one fill step")
    config = EngineConfig(
        device=device, dtype=dtype, cuda_graphs=False, num_kv_blocks=64 + (prompt_len + new) // 8
    )
    pair = random_models.load_pair(shape, config, seed)
    engine, hf = pair.engine, pair.hf
    try:
        ours: Records = defaultdict(list)
        handles = _hooked(engine_model(engine).model.decoder_layers, "self_attn", ours)
        vocab = random_models.hf_config(shape)["vocab_size"]
        prompt = torch.randint(
            3, vocab, (prompt_len,), generator=torch.Generator().manual_seed(seed)
        ).tolist()
        tokens = asyncio.run(_ours(engine, prompt, new))
        for h in handles:
            h.remove()
    finally:
        engine.shutdown()
    ids = torch.tensor([prompt + tokens[:-1]], device=hf.device)  # the last token is input to no step
    theirs: dict[str, Records] = {}
    reference = torch.float64 if config.torch_dtype() == torch.float32 else torch.float32
    for name, model in (("dtype", hf), ("ref", copy.deepcopy(hf).to(reference))):
        theirs[name] = defaultdict(list)
        handles = _hooked(model.model.layers, "self_attn", theirs[name])
        with torch.no_grad():
            model(ids)
        for h in handles:
            h.remove()
        del model
    errors = []
    for (layer, sub), calls in sorted(ours.items()):
        ref, own = theirs["ref"][(layer, sub)][0], theirs["dtype"][(layer, sub)][0]
        fill, steps = calls[0], calls[1:]  # the fill's rows, then one row per decode step
        phases = [("fill", fill, slice(0, prompt_len))]
        if steps:
            phases.append(("decode", torch.cat(steps), slice(prompt_len, prompt_len + len(steps))))
        for phase, x, rows in phases:
            errors.append(LayerError(layer, sub, phase, _rel(x, ref[rows]), _rel(own[rows], ref[rows])))
    return errors


def report(errors: list[LayerError], ratio: float) -> tuple[str, dict[str, float]]:
    """The table (one row per layer: each sublayer and phase, ours / HF's own) and the RESULT metrics."""
    cells: dict[int, dict[str, str]] = defaultdict(dict)
    for e in errors:
        cells[e.layer][f"{e.sublayer} {e.phase}"] = f"{e.ours:.2e} / {e.hf_own:.2e} ({e.ratio:.2f}x)"
    columns = [f"{s} {p}" for p in ("fill", "decode") for s in SUBLAYERS]
    rows = [[str(layer), *(cells[layer].get(c, "—") for c in columns)] for layer in sorted(cells)]
    table = markdown_table(["layer", *(f"{c}: ours / HF own" for c in columns)], rows, [True] * 5)
    over = [e.layer for e in errors if e.ratio > ratio]
    metrics = {
        f"{phase}_ratio_max": max((e.ratio for e in errors if e.phase == phase), default=float("nan"))
        for phase in ("fill", "decode")
    }
    metrics["first_over_layer"] = min(over, default=-1)
    return table, metrics


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="smollm2-135m", choices=list(random_models.SHAPES))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "float16", "bfloat16"))
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new", type=int, default=16, help="tokens generated (decode steps: one fewer)")
    p.add_argument("--ratio", type=float, default=2.0, help="ours / HF's own error that flags a layer")
    p.add_argument("--json", type=Path, help="write every layer's errors here")
    args = p.parse_args(argv)
    errors = measure(args.shape, args.device, args.dtype, args.prompt_len, args.new)
    table, metrics = report(errors, args.ratio)
    what = f"{args.shape}, {args.dtype} on {args.device}, prompt {args.prompt_len}, {args.new} new"
    print(f"## layer_diff — {what}\n")
    print(table)
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "args": vars(args) | {"json": str(args.json)},
                    "errors": [asdict(e) for e in errors],
                    "metrics": metrics,
                },
                indent=1,
            )
        )
    print(
        "RESULT layer_diff "
        + " ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in metrics.items())
    )


if __name__ == "__main__":
    main()
