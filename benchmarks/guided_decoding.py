"""What constrained decoding costs per token: the grammar mask (xgrammar) against free decoding.

Two measures on the same engine, in the same run:

- the mask alone: filling each row's token bitmask from its grammar matcher and applying it to a
  ``[batch, vocab]`` float32 logits tensor, in microseconds per row and token (the matcher walks a JSON
  schema's grammar through a real answer, so its states are those of real generation);
- decoding: ``batch`` concurrent generates under a JSON schema vs the same generates free (EOS ignored, so
  they write ``max_tokens`` each), in tokens per second; the ratio guided / free is the end-to-end cost.

    python -m benchmarks.guided_decoding [--quick | --tiny] [--model smollm2] [--json PATH]

The last line is ``RESULT guided_decoding mask_us_b<B>=... throughput_ratio_b<B>=...``.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import statistics
import time
from dataclasses import dataclass

import torch

from benchmarks.harness.flags import add_engine_flags, add_size_flags, set_threads
from benchmarks.harness.machine import machine_info
from benchmarks.harness.output import log, result_line, write_json
from server.engine import LLMEngine, SamplingParams
from server.engine.guided import Guide, mask_logits
from server.engine.sampling import GuidedDecoding

SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "steps": {"type": "array", "items": {"type": "string"}},
        "minutes": {"type": "integer"},
    },
    "required": ["title", "steps", "minutes"],
}
PROMPT = "Write a recipe for pancakes as JSON with a title, the steps, and the minutes it takes."
_ids = itertools.count(1)


@dataclass(frozen=True)
class Sizes:
    batches: tuple[int, ...]
    max_tokens: int
    repeats: int


SIZES = {"full": Sizes((1, 16, 64), 128, 5), "quick": Sizes((1, 16), 64, 3), "tiny": Sizes((1, 4), 8, 1)}


def mask_us_per_row(engine: LLMEngine, batch: int, tokens: list[int], repeats: int) -> float:
    """Median microseconds to mask one row for one token, over a real answer's grammar states."""
    grammar = engine.core.grammars.compile(GuidedDecoding("json_schema", json.dumps(SCHEMA)))
    logits = torch.randn(batch, engine.vocab_size)
    times = []
    for _ in range(repeats):
        guides: list[Guide | None] = [Guide(grammar) for _ in range(batch)]
        started = time.perf_counter()
        for token in tokens:
            mask_logits(logits, guides)
            for g in guides:
                g.accept(token)  # type: ignore[union-attr]
        times.append((time.perf_counter() - started) / (len(tokens) * batch) * 1e6)
    return statistics.median(times)


async def decode_tps(engine: LLMEngine, batch: int, sampling: SamplingParams) -> tuple[float, list[str]]:
    """Tokens per second of ``batch`` concurrent generates from the prompt, and their texts."""
    prompt = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPT}], add_generation_prompt=True, tokenize=False
    )
    ids = engine.tokenizer.encode(prompt, add_special_tokens=False)
    parent = next(_ids)
    await engine.fill(parent, ids)
    children = [next(_ids) for _ in range(batch)]
    started = time.perf_counter()
    results = await asyncio.gather(
        *[engine.generate(c, sampling, parent_context_id=parent) for c in children]
    )
    elapsed = time.perf_counter() - started
    for cid in (parent, *children):
        await engine.free_context(cid)
    return sum(len(r.token_ids) for r in results) / elapsed, [r.text for r in results]


async def measure(engine: LLMEngine, sizes: Sizes) -> dict[str, float]:
    guided = GuidedDecoding("json_schema", json.dumps(SCHEMA))
    free = SamplingParams(max_tokens=sizes.max_tokens, ignore_eos=True)
    constrained = SamplingParams(max_tokens=sizes.max_tokens, guided=guided)
    _, (answer, *_) = await decode_tps(engine, 1, constrained)  # warm-up, and a real answer's tokens
    tokens = engine.tokenizer.encode(answer, add_special_tokens=False)
    metrics: dict[str, float] = {}
    for batch in sizes.batches:
        runs: dict[str, list[float]] = {"free": [], "guided": []}
        for _ in range(sizes.repeats):  # interleaved, so machine noise hits both alike
            runs["free"].append((await decode_tps(engine, batch, free))[0])
            runs["guided"].append((await decode_tps(engine, batch, constrained))[0])
        free_tps, guided_tps = statistics.median(runs["free"]), statistics.median(runs["guided"])
        metrics[f"mask_us_b{batch}"] = mask_us_per_row(engine, batch, tokens, sizes.repeats)
        metrics[f"free_tps_b{batch}"] = free_tps
        metrics[f"guided_tps_b{batch}"] = guided_tps
        metrics[f"throughput_ratio_b{batch}"] = guided_tps / free_tps
        log(
            f"batch {batch}: free {free_tps:.1f} tok/s, guided {guided_tps:.1f} tok/s, mask "
            f"{metrics[f'mask_us_b{batch}']:.1f} us per row and token"
        )
    return metrics


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_size_flags(parser, "batches 1 and 16, 64 tokens, 3 repeats")
    add_engine_flags(parser)
    args = parser.parse_args(argv)
    set_threads(args)
    sizes = SIZES["tiny" if args.tiny else "quick" if args.quick else "full"]
    engine = LLMEngine.from_pretrained(args.model)
    try:
        metrics = asyncio.run(measure(engine, sizes))
    finally:
        engine.shutdown()
    print(f"model {engine.model_name}, sizes {sizes}")
    for batch in sizes.batches:
        print(
            f"batch {batch:>3}: mask {metrics[f'mask_us_b{batch}']:7.1f} us/row/token; "
            f"free {metrics[f'free_tps_b{batch}']:7.1f} tok/s, "
            f"guided {metrics[f'guided_tps_b{batch}']:7.1f} tok/s "
            f"({metrics[f'throughput_ratio_b{batch}']:.2f}x)"
        )
    if args.json:
        write_json(
            args.json,
            {
                "benchmark": "guided_decoding",
                "model": engine.model_name,
                "sizes": vars(sizes),
                "metrics": metrics,
                "machine": machine_info(),
            },
        )
    print(result_line("guided_decoding", metrics))


if __name__ == "__main__":
    main()
