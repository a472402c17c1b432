"""Helpers shared by the benchmark scripts: machine facts, deterministic workload text, statistics, output.

Every benchmark reports ratios measured side by side in one run (see DESIGN.md, "How performance is
measured"); these helpers keep the parts that are the same everywhere — what machine it ran on, where the
prompt text comes from, how repeats are summarised, how the table and the ``RESULT`` line are written — in
one place.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import statistics
import subprocess
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from workload_text import stdlib_text  # the workload text, here for the benchmarks that import it

Config = TypeVar("Config")

# Where this code lives: the checkout (git reads its commit there, the experiments run from there), or
# site-packages when installed as a wheel — never where results are written (`output_root`).
REPO_ROOT = Path(__file__).resolve().parents[1]


def output_root() -> Path:
    """Where results (``benchmarks/results/``) and the page (``docs/``) go unless told otherwise: the
    current directory — the checkout's root when run from there, as the README does; an installed package's
    own folder would be site-packages."""
    return Path.cwd()


# ----------------------------------------------------------------------------------------------- machine
def git_commit() -> dict[str, Any]:
    """The repository's HEAD commit and whether the work tree has uncommitted changes (None if no git)."""

    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(
                ["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10, check=True
            )
        except (OSError, subprocess.SubprocessError):
            return None
        return out.stdout.strip()

    status = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": git("rev-parse", "HEAD"), "dirty": None if status is None else bool(status)}


def cpu_model() -> str:
    """The CPU's marketing name (``/proc/cpuinfo`` on Linux, else what ``platform`` knows)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def load_average() -> float | None:
    """One-minute load average: on a shared machine, what else was running competes with the benchmark."""
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def machine_info() -> dict[str, Any]:
    """What a reader needs to judge the figures: CPU, cores, library versions, the code's commit."""
    import torch

    info: dict[str, Any] = {
        "cpu_model": cpu_model(),
        "logical_cores": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "load_average_1m": load_average(),
        "git": git_commit(),
    }
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        info["transformers"] = None
    return info


# ----------------------------------------------------------------------------------------------- workload
def document_chunks(tokenizer: Any, count: int, chunk_tokens: int) -> list[str]:
    """``count`` consecutive pieces of `stdlib_text`, ``chunk_tokens`` tokens each under ``tokenizer`` (a
    Hugging Face tokenizer), decoded back to text: a long document cut into parts."""
    need = count * chunk_tokens
    chars = 4 * need
    while True:
        ids = tokenizer(stdlib_text(chars), add_special_tokens=False).input_ids
        if len(ids) >= need:
            break
        chars *= 2
    return [tokenizer.decode(ids[i * chunk_tokens : (i + 1) * chunk_tokens]) for i in range(count)]


def render_template(template: str, values: Mapping[str, str]) -> str:
    """A request-centric client's rendering of a Parrot template: constant text with the input values in,
    cut at the first output placeholder — exactly the prompt the Parrot server renders for that step."""
    from parrot.protocol import TemplatePlaceholder, TemplateText, parse_template

    parts: list[str] = []
    for piece in parse_template(template):
        if isinstance(piece, TemplateText):
            parts.append(piece.text)
        elif isinstance(piece, TemplatePlaceholder) and piece.role == "input":
            parts.append(values[piece.name])
        else:
            break
    return "".join(parts)


# ----------------------------------------------------------------------------------------------- statistics
@dataclass(frozen=True)
class Spread:
    """The median of repeated measurements and their range."""

    median: float
    lo: float
    hi: float
    n: int

    @classmethod
    def of(cls, samples: Iterable[float]) -> Spread:
        xs = [x for x in samples if math.isfinite(x)]
        if not xs:
            return cls(math.nan, math.nan, math.nan, 0)
        return cls(statistics.median(xs), min(xs), max(xs), len(xs))

    @property
    def rel_half_range(self) -> float:
        """Half the range relative to the median (``±`` in the tables)."""
        if not self.median or not math.isfinite(self.median):
            return math.nan
        return (self.hi - self.lo) / 2 / abs(self.median)

    def as_dict(self) -> dict[str, float | int]:
        return {"median": self.median, "min": self.lo, "max": self.hi, "n": self.n}


@dataclass
class ClientResult:
    """One client in one setting of an application benchmark: per-repeat latencies (seconds) and the HTTP
    requests each run made."""

    seconds: list[float] = field(default_factory=list)
    requests: list[int] = field(default_factory=list)

    @property
    def spread(self) -> Spread:
        return Spread.of(self.seconds)


def percentile(xs: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100), linear between order statistics; NaN for no data."""
    if not xs:
        return math.nan
    ys = sorted(xs)
    pos = (len(ys) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(ys) - 1)
    return ys[lo] + (ys[hi] - ys[lo]) * (pos - lo)


def safe_ratio(a: float, b: float) -> float:
    """``a / b``, NaN when either is unusable (keeps a noisy repeat from crashing the report)."""
    if not (math.isfinite(a) and math.isfinite(b)) or b == 0:
        return math.nan
    return a / b


# ----------------------------------------------------------------------------------------------- sizes
def add_size_flags(parser: argparse.ArgumentParser, quick_help: str) -> None:
    """The flags every benchmark takes: ``--quick`` (about a minute on 2 cores), ``--tiny`` (a harness
    check in seconds) and ``--json PATH``."""
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help=quick_help)
    size.add_argument(
        "--tiny",
        action="store_true",
        help="the smallest configuration running every code path (a harness check: figures mean nothing)",
    )
    parser.add_argument("--json", metavar="PATH", help="write the figures and machine info as JSON")


def add_engine_flags(parser: argparse.ArgumentParser, model: bool = True) -> None:
    """The flags of scripts that run the real engine: ``--model`` (with ``model``) and ``--threads``
    (applied by `set_threads`)."""
    if model:
        parser.add_argument("--model", default="tiny", help='"tiny" (default) or a local Hugging Face folder')
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")


def set_threads(args: argparse.Namespace) -> None:
    """Apply ``--threads`` (`add_engine_flags`) to torch, if given."""
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)


def int_list(text: str) -> tuple[int, ...]:
    """An argparse type: ``"16,32,64"`` -> ``(16, 32, 64)``, each at least 1; ``""`` is an empty sweep."""
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def sized(args: argparse.Namespace, full: Config, quick: Config, tiny: Config, **overrides: Any) -> Config:
    """The configuration ``args`` asks for (`add_size_flags`), with every override that is not None."""
    cfg = tiny if args.tiny else quick if args.quick else full
    return dataclasses.replace(cfg, **{k: v for k, v in overrides.items() if v is not None})  # type: ignore[type-var]


# ----------------------------------------------------------------------------------------------- output
def fmt_num(x: float, digits: int = 0) -> str:
    """Thousands-separated number, ``n/a`` for NaN."""
    if not math.isfinite(x):
        return "n/a"
    return f"{x:,.{digits}f}"


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[str]], right: Sequence[bool]) -> str:
    """A GitHub markdown table with padded columns (readable as plain text too)."""
    widths = [max([len(h), *(len(r[i]) for r in rows)]) for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        padded = (c.rjust(w) if r else c.ljust(w) for c, w, r in zip(cells, widths, right, strict=True))
        return "| " + " | ".join(padded) + " |"

    rule = "|" + "|".join(
        ("-" * (w + 1) + ":") if r else ("-" * (w + 2)) for w, r in zip(widths, right, strict=True)
    )
    return "\n".join([line(headers), rule + "|", *(line(r) for r in rows)])


def bench_dtype(device: Any, name: str | None = None) -> str:
    """The dtype a benchmark times in: ``name`` if given, else bfloat16 on CUDA and float32 on CPU."""
    return name or ("bfloat16" if getattr(device, "type", device) == "cuda" else "float32")


def result_line(name: str, metrics: dict[str, float | int]) -> str:
    """The ``RESULT <name> k=v ...`` line every benchmark ends with."""

    def value(v: float | int) -> str:
        if isinstance(v, int):
            return str(v)
        return "nan" if not math.isfinite(v) else f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"

    return f"RESULT {name} " + " ".join(f"{k}={value(v)}" for k, v in metrics.items())


def write_json(path: str | Path, payload: dict[str, Any]) -> None:
    """Write ``payload`` as indented JSON (NaN becomes null: strict JSON readers reject NaN)."""

    def clean(x: Any) -> Any:
        if isinstance(x, float) and not math.isfinite(x):
            return None
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [clean(v) for v in x]
        return x

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(clean(payload), indent=2) + "\n")


def log(message: str) -> None:
    """Progress on stderr, so stdout holds only the tables and the RESULT line."""
    print(message, file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------------- hardware
def memory_bandwidth(size_mib: int = 256, repeats: int = 9) -> dict[str, float | int]:
    """Main-memory bandwidth as torch sees it with its current threads, in bytes per second.

    Three kernels over ``size_mib`` of fp32, each timed ``repeats`` times after one untimed pass that
    faults the pages in: ``sum`` (one read of every byte, next to no arithmetic), ``gemv`` (a matrix times
    a vector: how a batch-1 decode step reads its weights) and ``copy`` (read + write, counted as twice the
    bytes). ``read_bytes_per_s`` is the better of the two reads' medians (on some CPUs ``sum`` does not
    saturate memory with few threads, a matrix-vector product does). Measure it in the same run as the
    figures it bounds: on a shared machine the other load moves it too.
    """
    import time

    import torch

    n = size_mib * (1 << 20) // 4
    cols = 4096
    src = torch.ones(n, dtype=torch.float32)
    dst = torch.empty_like(src)
    matrix = src[: n - n % cols].view(-1, cols)
    vector = torch.ones(cols, dtype=torch.float32)
    kernels = {
        "sum": (lambda: src.sum(), src.numel() * 4),
        "gemv": (lambda: torch.mv(matrix, vector), matrix.numel() * 4),
        "copy": (lambda: dst.copy_(src), 2 * src.numel() * 4),
    }
    medians: dict[str, float] = {}
    best: dict[str, float] = {}
    for name, (kernel, nbytes) in kernels.items():
        kernel()
        rates = []
        for _ in range(repeats):
            start = time.perf_counter()
            kernel()
            rates.append(nbytes / (time.perf_counter() - start))
        medians[name], best[name] = statistics.median(rates), max(rates)
    return {
        "read_bytes_per_s": max(medians["sum"], medians["gemv"]),
        **{f"{name}_bytes_per_s": v for name, v in medians.items()},
        **{f"{name}_bytes_per_s_max": v for name, v in best.items()},
        "tensor_bytes": n * 4,
        "repeats": repeats,
        "threads": torch.get_num_threads(),
    }


# ----------------------------------------------------------------------------------------------- models
def engine_model(engine: Any) -> Any:
    """The ``torch.nn.Module`` a loaded `server.engine.LLMEngine` runs (its parameters are the weights)."""
    # The engine does not expose its model publicly; the runner holds it (`ModelRunner.model`).
    model = getattr(getattr(engine, "_runner", None), "model", None)
    if model is None:
        raise TypeError(f"{type(engine).__name__} has no loaded torch model to read weights from")
    return model


def hf_config_dict(model_config: Any, dtype: str, pad_token_id: int | None = None) -> dict[str, Any]:
    """A Hugging Face ``LlamaForCausalLM`` ``config.json`` for an engine `ModelConfig`.

    Rope settings are written in both forms (transformers 5's ``rope_parameters``, 4.x's ``rope_theta`` +
    ``rope_scaling``), so every transformers (and vLLM, which reads configs through it) version reads them.
    """
    cfg = model_config
    scaling = dict(cfg.rope_scaling) if cfg.rope_scaling else None
    eos = list(cfg.eos_token_ids)
    out: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": scaling,
        "rope_parameters": {**(scaling or {"rope_type": "default"}), "rope_theta": cfg.rope_theta},
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "attention_bias": cfg.attention_bias,
        "mlp_bias": cfg.mlp_bias,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
        "torch_dtype": dtype,
        "dtype": dtype,
    }
    if pad_token_id is not None:
        out["pad_token_id"] = pad_token_id
    return out


def export_hf_folder(engine: Any, folder: str | Path) -> Path:
    """Write the weights a `server.engine.LLMEngine` has loaded as a Hugging Face model folder.

    For baselines (transformers, vLLM) that load only Hugging Face folders, when our engine loaded a model
    from something else (a GGUF file, a name): they then run exactly our weights, in our engine's dtype.
    The engine's parameter names are Hugging Face ``LlamaForCausalLM``'s; a tied ``lm_head`` is one
    parameter and is written once, as HF expects. Writes ``config.json`` (from the engine's `ModelConfig`),
    ``model.safetensors`` and the tokenizer (``save_pretrained``).
    """
    import torch
    from safetensors.torch import save_file

    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    model = engine_model(engine)
    # named_parameters() yields a shared (tied) tensor once, under its first name (the embedding).
    state = {name: p.detach().to("cpu").contiguous() for name, p in model.named_parameters()}
    odd = sorted(name for name, t in state.items() if not torch.is_floating_point(t))
    if odd:
        raise ValueError(f"cannot export non-floating-point (quantized?) weights as a HF folder: {odd[:5]}")
    dtypes = {t.dtype for t in state.values()}
    dtype = str(max(dtypes, key=lambda d: d.itemsize)).removeprefix("torch.")
    tokenizer = engine.tokenizer
    pad = getattr(tokenizer, "pad_token_id", None)
    config = hf_config_dict(engine.model_config, dtype, pad if isinstance(pad, int) else None)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save_pretrained(str(out))
    return out


def quiet_transformers() -> None:
    """Show only transformers' errors: a benchmark tokenizes long texts on purpose (whole workloads), which
    its warning about sequences longer than the model's window would otherwise flag every time."""
    import transformers

    transformers.utils.logging.set_verbosity_error()
