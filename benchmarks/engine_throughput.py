"""Engine throughput: our paged-KV engine vs Hugging Face ``generate`` (and vLLM) on the same weights.

Batches of 1, 16 and 64 prompts (stdlib docstrings, lengths spread over ``[spread * L, L]``), greedy, exactly
N new tokens each, on CPU; ours in its default dtype (bf16 where the CPU has native bf16, else fp32) or
``--dtype``, HF in the same, vLLM in ``--vllm-dtype``. ``T(1)`` / ``T(N)``: wall time from submitting the
batch to every request's first / N-th token (ours: ``fill`` + ``generate`` per request, all at once; HF:
``generate`` over the left-padded batch; vLLM: ``LLM.generate`` on the same token ids, prefix caching off,
timed in its worker process, ``benchmarks/vllm_worker.py``). Medians over at least ``--repeats``
interleaved repeats after a warm-up, ± half the range of the per-repeat figures
(`benchmarks.harness.batch_timing.time_batch`):

* **prefill tok/s** = real (unpadded) prompt tokens / ``T(1)``;
* **decode tok/s** = ``B (N - 1) / (T(N) - T(1))``; **end-to-end tok/s** = ``B N / T(N)``.

Batch-1 decode ceiling: memory read bandwidth (same run) / the weight bytes one decode step reads; prefill
ceiling: the model's own linears at 2,048 rows / their FLOPs per token; ours is a share of each. A model
that is not a HF folder is exported from our engine, so HF and vLLM run exactly our weights.

KV memory: ``kv_requests`` requests sharing a ``kv_prefix``-token prefix, each with a distinct suffix,
blocks counted exactly with every context alive, with fork (the prefix filled once) and without.

vLLM (``--vllm-python PATH``: an interpreter of a separate virtualenv with vLLM, e.g. its CPU build): its
OpenMP threads bound to our cores and thread count, no core reserved, a KV cache that fits the largest batch
(`benchmarks.harness.vllm_settings.vllm_env`; ``--vllm-env K=V`` overrides, e.g. ``LD_PRELOAD=...``).
Not a paper figure: the engine under every other experiment, against its baselines.

    python -m benchmarks.engine_throughput [--quick] [--json PATH] [--model PATH] [--repeats N]
        [--dtype D] [--vllm-python PATH [--vllm-dtype D] [--vllm-engine-args JSON] [--vllm-env K=V ...]]

Last line: ``RESULT engine_throughput decode_ratio_b1=... prefill_ratio_b64=... kv_fork_ratio=...
mem_bw_gbs=... decode_b1_pct_ceiling=...`` (ours/HF), then ``decode_vs_vllm_b1=...`` and the like
(ours/vLLM) when vLLM ran.
"""

from __future__ import annotations

import math
import sys
import tempfile
from dataclasses import asdict, dataclass, replace
from pathlib import Path

if not __package__:
    # Run as a file, this script's directory would come first on sys.path (where `benchmarks/kernels.py`
    # shadows the `kernels` package); put the repository root there instead.
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from benchmarks.harness import record
from benchmarks.harness.decode_ceiling import decode_ceiling
from benchmarks.harness.engine_batches import make_prompts, measure_batch, workload
from benchmarks.harness.engine_models import engine_model
from benchmarks.harness.engine_report import Run, metrics, print_report
from benchmarks.harness.generators import DTYPES, Generator, OurEngine, dtype_name, model_record
from benchmarks.harness.hf_generate import HFGenerate, load_baseline, pad_token_id
from benchmarks.harness.kv_fork import blocks, measure_kv
from benchmarks.harness.machine import memory_bandwidth
from benchmarks.harness.openai_route import openai_routes
from benchmarks.harness.output import log
from benchmarks.harness.prefill_ceiling import prefill_ceiling
from benchmarks.harness.roofline import measure_roofline
from benchmarks.harness.vllm_generate import start_vllm
from benchmarks.harness.vllm_settings import add_vllm_flags
from server.engine import EngineConfig, LLMEngine
from server.engine.compute_thread import on_own_thread

NAME = "engine_throughput"


@dataclass(frozen=True)
class BenchConfig:
    batches: tuple[int, ...] = (1, 16, 64)
    prompt_len: int = 512  # the longest prompt; the others are spread down to `spread * prompt_len`
    spread: float = 0.5
    new_tokens: int = 128
    repeats: int = 5  # at least; small batches get more (`batch_timing.time_batch`)
    min_time_s: float = 20.0  # timed seconds per batch size before the repeats may stop
    kv_requests: int = 32
    kv_prefix: int = 2048
    kv_suffix: int = 16
    kv_new_tokens: int = 8
    seed: int = 0
    bandwidth_mib: int = 256  # the tensor the memory bandwidth is measured on (far larger than any cache)
    bandwidth_repeats: int = 9
    peak_size: int = 2048  # the torch.mm cube the library peak is measured on (`roofline`)


FULL = BenchConfig()
QUICK = BenchConfig(prompt_len=64, new_tokens=16, repeats=3, min_time_s=1.5, kv_prefix=512)  # 1,024: +12 s
TINY = BenchConfig(batches=(1, 4), prompt_len=16, new_tokens=4, repeats=1, min_time_s=0.0, kv_requests=4)
TINY = replace(TINY, kv_prefix=64, bandwidth_mib=16, bandwidth_repeats=3, peak_size=256)


# ----------------------------------------------------------------------------------------------- run
def engine_config(cfg: BenchConfig, dtype: str | None) -> EngineConfig:
    """The defaults, with enough KV blocks and sequence slots that nothing is preempted."""
    block, max_batch = EngineConfig().block_size, max(cfg.batches)
    # Every context of the biggest batch alive at its longest (contexts are freed between runs).
    throughput = max_batch * (blocks(cfg.prompt_len + cfg.new_tokens, block) + 1)
    memory = cfg.kv_requests * blocks(cfg.kv_prefix + cfg.kv_suffix + cfg.kv_new_tokens, block) + 64
    slots = max(max_batch, cfg.kv_requests)
    return EngineConfig(num_kv_blocks=max(throughput, memory), max_num_seqs=slots, device="cpu", dtype=dtype)


def run_all(cfg: BenchConfig, ours: OurEngine, others: list[Generator]) -> Run:
    """The memory bandwidth, the throughput rows for every batch size, then the KV memory comparison."""
    engine, limit = ours.engine, ours.engine.max_model_len
    if cfg.prompt_len + cfg.new_tokens > limit:
        raise SystemExit(f"prompt_len + new tokens exceed the model's context window ({limit})")
    longest = max(cfg.kv_prefix + cfg.kv_requests * cfg.kv_suffix, cfg.prompt_len)
    tokens = workload(engine.tokenizer, 4 * longest)
    log(f"memory bandwidth ({cfg.bandwidth_mib} MiB, {cfg.bandwidth_repeats} repeats) ...")
    bandwidth = on_own_thread(lambda: memory_bandwidth(cfg.bandwidth_mib, cfg.bandwidth_repeats), "bandwidth")
    results = []
    for batch in cfg.batches:
        prompts = make_prompts(tokens, batch, cfg)
        log(f"batch {batch}: {sum(map(len, prompts))} prompt tokens, {cfg.new_tokens} new each")
        results.append(measure_batch(ours, others, prompts, cfg))
    p, s = min(cfg.kv_prefix, limit - cfg.kv_suffix - cfg.kv_new_tokens - 1), cfg.kv_suffix
    # Distinct suffixes from elsewhere in the text, so no two requests share more than the prefix.
    suffixes = [tokens[p + i * s : p + (i + 1) * s] for i in range(cfg.kv_requests)]
    log(f"KV memory: {cfg.kv_requests} requests sharing a {p}-token prefix")
    kv = ours.call(measure_kv(ours, tokens[:p], suffixes, cfg.kv_new_tokens))
    b1 = next((r.systems["ours"].decode_tps.value for r in results if r.batch == 1), math.nan)
    torch_dtype, model, big = engine.config.torch_dtype(), engine_model(engine), results[-1].systems
    ceiling = decode_ceiling(bandwidth, model, dtype_name(torch_dtype), b1)
    prefill = prefill_ceiling(model, big["ours"])
    rates = measure_roofline(results, model, torch_dtype, ceiling, prefill, cfg.peak_size)
    return Run(results, kv, ceiling, prefill, rates)


# ----------------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> None:
    p = record.parser(
        __doc__,
        "short prompts and outputs, 3 repeats (~2 min with vLLM)",
        BenchConfig,
        repeats="least timed repeats per batch size (median)",
        prompt_len="longest prompt in tokens",
        new_tokens="tokens generated per request",
        spread="shortest prompt / longest prompt (1: all equal)",
    )
    p.add_argument("--batches", type=int, nargs="+", help="batch sizes (default 1 16 64)")
    p.add_argument("--dtype", choices=DTYPES, help="our engine's and HF's (default: the engine's)")
    p.add_argument(
        "--no-openai",
        dest="openai",
        action="store_false",
        help="skip the OpenAI route (Parrot's /v1 and, with --vllm-python, vLLM's api_server)",
    )
    add_vllm_flags(p)
    args = p.parse_args(argv)
    cfg = record.configured(args, FULL, QUICK, TINY)
    cfg = replace(cfg, batches=tuple(cfg.batches))
    rec = record.Recorder(NAME, args)
    config = engine_config(cfg, args.dtype)
    log(f"loading {args.model} into our engine and into transformers ...")
    with (
        tempfile.TemporaryDirectory(prefix=f"{NAME}-") as tmp,
        LLMEngine.from_pretrained(args.model, config=config) as engine,
    ):
        folder, hf = load_baseline(args.model, engine, Path(tmp))
        ours = OurEngine(engine)
        others: list[Generator] = [HFGenerate(hf, pad_token_id(engine.tokenizer, hf))]
        max_len = min(engine.max_model_len, cfg.prompt_len + cfg.new_tokens + 16)
        vllm = start_vllm(args, folder, engine, max_len, max(cfg.batches), Path(tmp))
        try:
            with openai_routes(args, engine, config, folder, max_len, max(cfg.batches), Path(tmp)) as routes:
                run = run_all(cfg, ours, others + ([vllm] if vllm else []) + routes)
        finally:
            ours.close()
            if vllm is not None:
                vllm.close()
        model = model_record(args.model, engine)
    model["hf_attn_implementation"] = getattr(hf.config, "_attn_implementation", None)
    dtypes = {"ours": run.ceiling.dtype, "hf": dtype_name(hf.dtype)}
    if vllm is not None:
        dtypes["vllm"] = str(vllm.info.get("dtype"))
    print(rec.header(f"{model['name']} ({model['parameters'] / 1e6:.1f}M params)"))
    print_report(cfg, run, dtypes, vllm.info if vllm else None)
    rec.finish(
        metrics(run),
        config=cfg,
        model=model,
        dtypes=dtypes,
        engine_config=config,
        vllm=vllm.info if vllm else None,
        throughput=[asdict(r) | {"outputs": None} for r in run.results],  # the tokens: not a figure
        decode_ceiling=run.ceiling,
        prefill_ceiling=run.prefill,
        kv_memory={**asdict(run.kv), "ratio": run.kv.ratio},
        roofline=run.roofline,
    )


if __name__ == "__main__":
    main()
