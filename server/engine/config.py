"""Engine and model configuration.

`ModelConfig` is read from a Hugging Face `config.json` (both the transformers 4.x `rope_scaling` form and
the 5.x `rope_parameters` form); `EngineConfig` holds the serving knobs. torch is imported where a value
needs it, not at import: the command lines read these defaults before anything heavy loads.
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from server.common.config_flags import Flag, flagged, fraction
from server.engine.ordering import (
    DEFAULT_SJF_AGING_S,
    SCHEDULING_POLICIES,
    SchedulingPolicy,
    check_policy,
)

if TYPE_CHECKING:
    import torch

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM",)


@dataclass(frozen=True)
class ModelConfig:
    """The LLaMA-family hyper-parameters our model code needs."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Parse a Hugging Face LLaMA config dict; raise ValueError for architectures we do not run."""
        arch = cfg.get("architectures") or ["LlamaForCausalLM"]
        model_type = cfg.get("model_type", "llama")
        if model_type != "llama" and not set(arch) & set(SUPPORTED_ARCHITECTURES):
            raise ValueError(
                f"unsupported model: model_type={model_type!r}, architectures={arch}; "
                f"this engine runs the LLaMA family ({', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"unsupported hidden_act {act!r}: LLaMA models use 'silu' (SwiGLU)")
        heads = cfg["num_attention_heads"]
        # transformers 5 moved rope settings into `rope_parameters`; 4.x keeps `rope_theta` + `rope_scaling`.
        rope_params = dict(cfg.get("rope_parameters") or {})
        theta = rope_params.pop("rope_theta", cfg.get("rope_theta", 10000.0))
        scaling = cfg.get("rope_scaling") or (rope_params or None)
        if scaling is not None:
            scaling = dict(scaling)
            scaling.setdefault("rope_type", scaling.get("type", "default"))
            if scaling["rope_type"] == "default":
                scaling = None
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=scaling,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelConfig:
        config_file = Path(path) / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(
                f"{config_file} not found: a model folder needs a Hugging Face config.json"
            )
        return cls.from_hf_dict(json.loads(config_file.read_text()))


def default_dtype(device: torch.device) -> torch.dtype:
    """bf16 on CUDA where supported, else fp16; on CPU bf16 where the CPU computes it natively
    (`cpu_has_native_bf16`), else fp32."""
    import torch

    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if cpu_has_native_bf16() else torch.float32


_NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


@functools.cache
def cpu_has_native_bf16() -> bool:
    """Whether this CPU runs bf16 matrix products natively, so bf16 halves the bytes a step moves without
    costing compute: an x86 CPU with AVX512-BF16 or AMX-BF16 (Cooper Lake, Sapphire Rapids and later Xeons,
    AMD Zen 4 and later), with torch's oneDNN able to use it.

    Detected from two sources, either sufficing for the instruction set: torch's own CPU feature probe
    (``torch.cpu._is_avx512_bf16_supported`` / ``_is_amx_tile_supported``, from cpuid) and, on Linux, the
    ``avx512_bf16`` / ``amx_bf16`` flags of ``/proc/cpuinfo``; plus oneDNN's own answer that it runs bf16
    here (``torch.ops.mkldnn._is_mkldnn_bf16_supported``). Without native support (AVX2-only or plain
    AVX-512 parts) torch emulates bf16 products through fp32 conversions, measured 1.1-10x slower than fp32
    on an AVX2 EPYC, so fp32 stays the default there; ARM's bf16 extensions are not considered.
    """
    import torch

    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    probes = (
        getattr(torch.cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    )
    isa = any(probe() for probe in probes if probe is not None)
    return (isa or bool(_NATIVE_BF16_FLAGS & _proc_cpuinfo_flags())) and _onednn_runs_bf16()


def _onednn_runs_bf16() -> bool:
    import torch

    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # an older or oneDNN-less build: no fast bf16 products
        return False


def _proc_cpuinfo_flags() -> frozenset[str]:
    """The CPU flags Linux reports; empty elsewhere or if unreadable."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return frozenset()


def step_activation_bytes(model: ModelConfig, config: EngineConfig, dtype: torch.dtype) -> int:
    """A bound on one step's activations: the widest per-token tensors (q/k/v, gate/up and the MLP's
    product, residual and norm) for ``max_num_batched_tokens`` tokens, twice for the allocator's overlap,
    plus fp32 logits of ``max_num_seqs`` rows."""
    qkv = (model.num_attention_heads + 2 * model.num_key_value_heads) * model.head_dim
    per_token = (qkv + 3 * model.intermediate_size + 4 * model.hidden_size) * dtype.itemsize
    return 2 * config.max_num_batched_tokens * per_token + config.max_num_seqs * model.vocab_size * 4


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


EngineRole = Literal["prefill", "decode", "both"]
ENGINE_ROLES: tuple[str, ...] = ("prefill", "decode", "both")
DTYPES = ("float32", "float16", "bfloat16")


def _aging_seconds(text: str) -> float:
    """``--sjf-aging-s``'s text: a finite number of seconds > 0."""
    try:
        value = float(text)
        check_policy("sjf", value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text!r}: a finite number of seconds > 0") from e
    return value


@dataclass(frozen=True)
class EngineConfig:
    """Serving knobs. A field made with `flagged` is also a command-line flag of both CLIs
    (`ENGINE_FLAGS`, `SERVER_ENGINE_FLAGS`), with the field's default.

    The KV cache holds ``num_kv_blocks`` blocks if given, else as many as fit in ``kv_cache_memory_bytes``,
    else (default) 256 MiB on CPU; on a GPU, what is left of ``gpu_memory_utilization`` x the GPU's total
    memory after this engine's weights and step activations (as vLLM sizes it), so engines sharing one GPU
    each take their own fraction (e.g. 0.4 each for two).
    """

    block_size: int = flagged(16, Flag("tokens per KV block"))
    num_kv_blocks: int | None = flagged(
        None, Flag("KV cache blocks of each engine (default: what fits)", parse=int)
    )
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = flagged(
        0.85,
        Flag(
            "share of the GPU's memory each engine may take, weights included (several engines on one GPU: "
            "split it, e.g. 0.4 each)",
            parse=fraction,
        ),
    )
    max_num_batched_tokens: int = flagged(2048, Flag("tokens one step computes at most"))
    max_num_seqs: int = flagged(64, Flag("requests one step runs at most"))
    # FIFO token cap: the head of the waiting queue joins the running batch only while the running
    # requests' reservations, its own included, stay within this (`server.engine.scheduler`). None: only
    # the KV cache and max_num_seqs limit the batch. The latency-capped baseline of the benchmarks sets it.
    max_running_tokens: int | None = flagged(
        None,
        Flag(
            "each engine's FIFO token cap on its running batch: prompt + max new tokens of what runs (the "
            "latency-capped baseline; default: none)",
            parse=int,
        ),
    )
    max_model_len: int | None = flagged(None, Flag("context window (default: the model's own)", parse=int))
    device: str = field(default_factory=_default_device)
    # "float32" | "float16" | "bfloat16"; default per device (`default_dtype`), float32 for the "tiny" model
    dtype: str | None = flagged(
        None,
        Flag(
            "weights and activations (default: bfloat16 on a GPU that has it, else float16; on CPU bfloat16 "
            "where the CPU computes it natively, else float32)",
            choices=DTYPES,
        ),
    )
    # Group decodes that share prefix blocks into one pass over the prefix: "auto" where it pays
    # (`kernels.should_share_prefix`), "always" (tests), "never" (ablations).
    shared_prefix_decode: Literal["auto", "always", "never"] = flagged(
        "auto",
        Flag(
            "decodes sharing prefix blocks read them in one pass (auto: where it pays)",
            choices=("auto", "always", "never"),
        ),
    )
    seed: int = 0  # seed of the embedded "tiny" model's weights
    # Keep the features and wall time of the last this-many steps (`LLMEngine.step_trace`; 0: off), the
    # data the simulator's latency model is fitted to. On a GPU a traced step waits for the device, so its
    # time is the step's, not the host's queueing (the host then no longer runs ahead of the device).
    trace_steps: int = 0
    # The order of the waiting queue (`server.engine.ordering`): "fcfs" (arrival) or "sjf" (lowest
    # `generate(priority=)` first, within objective classes, never preempting). Under "sjf", a request
    # queued for `sjf_aging_s` seconds is overtaken by nothing queued after it (the aging bound).
    scheduling: SchedulingPolicy = flagged(
        "fcfs",
        Flag(
            "order of each engine's waiting queue: fcfs (arrival) or sjf (shortest predicted output first, "
            "with aging)",
            choices=SCHEDULING_POLICIES,
        ),
    )
    sjf_aging_s: float = flagged(
        DEFAULT_SJF_AGING_S,
        Flag(
            "under sjf: a request queued this long is overtaken by nothing queued after it",
            parse=_aging_seconds,
            metavar="SECONDS",
        ),
    )
    # Disaggregated serving (Mutel): what the manager places here. "prefill" instances compute
    # prompts and keep their KV for the next turn, lending it to decode instances (`kv_exchange`);
    # "decode" instances run decodes over it (`remote_kv`); "both" is the colocated default.
    role: EngineRole = flagged(
        "both",
        Flag(
            "disaggregated serving: prefill instance, decode instance, or both (colocated)",
            choices=ENGINE_ROLES,
        ),
    )
    # On a GPU, replay pure decode steps as CUDA graphs captured per batch-size bucket at start
    # (`server.engine.cuda_graphs`; vLLM's default too). False: every step eager (vLLM's enforce_eager).
    cuda_graphs: bool = flagged(
        True, Flag("on a GPU, run every step eagerly (no CUDA graphs)", name="--enforce-eager", negates=True)
    )
    # Batch invariance (CPU, bf16): a token's result does not depend on what else runs in its step, how its
    # prompt was chunked or whether its prefix was forked, so greedy answers compare exactly between
    # schedules in bf16 (the benchmarks' setting). Every fill token attends as a row of the decode kernel,
    # decodes are never grouped over shared prefixes, and every linear runs our packed GEMM (each output
    # row summed in one order at any row count). Needs our CPU kernels (`ValueError` at start without).
    # Not covered: contexts over another engine's KV (`remote_kv`), whose attention merges two partials.
    batch_invariant: bool = flagged(
        False,
        Flag(
            "a token's result independent of its batch, chunking and forks (CPU, bf16: greedy answers "
            "compare exactly between schedules; refuses to start where it cannot hold)"
        ),
    )

    def __post_init__(self) -> None:
        check_policy(self.scheduling, self.sjf_aging_s)
        if self.batch_invariant and self.shared_prefix_decode == "always":
            raise ValueError("batch_invariant never groups shared-prefix decodes: drop shared_prefix_decode")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.role not in ENGINE_ROLES:
            raise ValueError(f"unknown engine role {self.role!r}; use one of {', '.join(ENGINE_ROLES)}")

    def kv_cache_bytes(self, model_bytes: int = 0, activation_bytes: int = 0) -> int:
        """The memory the KV cache may take, given this engine's weights and its steps' activations (called
        after the weights are loaded). On a GPU: ``gpu_memory_utilization`` of the total, less those, and
        never more than is free (less 2%: the allocator's slack); `ValueError` when nothing is left."""
        if self.kv_cache_memory_bytes is not None:
            return self.kv_cache_memory_bytes
        import torch

        device = self.torch_device()
        if device.type != "cuda":
            return 256 * 1024 * 1024
        free, total = torch.cuda.mem_get_info(device)
        budget = int(self.gpu_memory_utilization * total) - model_bytes - activation_bytes
        usable = min(budget, free - total // 50)
        if usable <= 0:
            raise ValueError(
                f"no GPU memory left for the KV cache: gpu_memory_utilization={self.gpu_memory_utilization} "
                f"of {total / 2**30:.1f} GiB is {self.gpu_memory_utilization * total / 2**30:.1f} GiB, "
                f"the weights take {model_bytes / 2**30:.1f} GiB and step activations "
                f"~{activation_bytes / 2**30:.1f} GiB, "
                f"{free / 2**30:.1f} GiB is free; raise gpu_memory_utilization or set num_kv_blocks"
            )
        return usable

    def model_len(self, model: ModelConfig) -> int:
        """The context window: ``max_model_len`` if set, never past the model's positions."""
        return min(model.max_position_embeddings, self.max_model_len or model.max_position_embeddings)

    def torch_device(self) -> torch.device:
        import torch

        return torch.device(self.device)

    def torch_dtype(self) -> torch.dtype:
        import torch

        if self.dtype is None:
            return default_dtype(self.torch_device())
        dtype = getattr(torch, self.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"unknown dtype {self.dtype!r}; use float32, float16 or bfloat16")
        return dtype


# The fields `python -m server.engine` takes as flags, and those `python -m server` passes to its engines.
SERVER_ENGINE_FLAGS = (
    "num_kv_blocks",
    "gpu_memory_utilization",
    "cuda_graphs",
    "dtype",
    "max_running_tokens",
    "scheduling",
    "sjf_aging_s",
)
ENGINE_FLAGS = (
    *SERVER_ENGINE_FLAGS,
    "block_size",
    "max_num_batched_tokens",
    "max_num_seqs",
    "max_model_len",
    "shared_prefix_decode",
    "batch_invariant",
    "role",
)
