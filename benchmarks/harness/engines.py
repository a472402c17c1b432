"""Engine-level comparisons: one batch of greedy generations on our engine, Hugging Face ``generate`` and
vLLM (in a worker process of its own interpreter), timed alike, with no server in between.

Every system is a `Generator`: ``run(prompts, n)`` generates exactly ``n`` tokens greedily for every prompt
of the batch at once and returns (seconds, token ids). `time_batch` times ``T(1)`` and ``T(N)`` of each,
interleaved, and turns them into prefill, decode and end-to-end tok/s (`Rates`). `decode_ceiling` bounds
batch-1 decode by memory bandwidth over the weight bytes one step reads.

The vLLM worker (`VLLMWorker`, the other side is ``benchmarks/vllm_worker.py``) leads a process group of
its own (`start_group`): vLLM's engine processes join it, and the whole group is stopped when the worker
is closed, when this process exits, or when it gets SIGTERM or SIGINT.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import contextlib
import itertools
import json
import math
import os
import queue
import signal
import subprocess
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from types import FrameType
from typing import Any, Protocol

import torch

from benchmarks.common import Spread, engine_model, export_hf_folder, log, safe_ratio
from benchmarks.harness.measure import Ratio
from server.engine import LLMEngine, SamplingParams
from server.engine.compute_thread import on_own_thread
from server.engine.config import cpu_has_native_bf16
from server.engine.model_names import resolve_model

__all__ = [
    "DTYPES",
    "WORKER_SCRIPT",
    "Ceiling",
    "Generator",
    "HFGenerate",
    "OurEngine",
    "Rate",
    "Rates",
    "Timed",
    "VLLMWorker",
    "add_vllm_flags",
    "cpu_list",
    "decode_ceiling",
    "decode_weight_bytes",
    "dtype_name",
    "hf_folder",
    "kv_cache_gib",
    "left_pad",
    "load_baseline",
    "load_hf",
    "model_record",
    "pad_token_id",
    "start_group",
    "start_vllm",
    "stop_group",
    "time_batch",
    "vllm_env",
]

WORKER_SCRIPT = Path(__file__).resolve().parents[1] / "vllm_worker.py"
DTYPES = ("float32", "float16", "bfloat16")
Outputs = list[list[int]]


class Generator(Protocol):
    """A way to run a batch of greedy generations; every system of a comparison is driven through it."""

    name: str

    def run(self, prompts: Sequence[list[int]], max_new_tokens: int) -> tuple[float, Outputs]:
        """Generate ``max_new_tokens`` greedily for every prompt at once; return (seconds, token ids)."""
        ...


# ----------------------------------------------------------------------------------------------- ours, HF
class OurEngine:
    """Our engine, driven as the manager drives it: per request a fill then a generate, all concurrent."""

    name = "ours"

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        # One event loop for the whole run: results come back into it from the engine thread.
        self._loop = asyncio.new_event_loop()
        self._ids = itertools.count(1)

    def run(self, prompts: Sequence[list[int]], max_new_tokens: int) -> tuple[float, Outputs]:
        return self.call(self._run(prompts, max_new_tokens))

    async def _run(self, prompts: Sequence[list[int]], max_new_tokens: int) -> tuple[float, Outputs]:
        sampling = SamplingParams(max_tokens=max_new_tokens, ignore_eos=True)
        ids = self.context_ids(len(prompts))

        async def one(cid: int, prompt: list[int]) -> list[int]:
            await self.engine.fill(cid, prompt)
            return (await self.engine.generate(cid, sampling)).token_ids

        start = time.perf_counter()
        outputs = await asyncio.gather(*(one(c, p) for c, p in zip(ids, prompts, strict=True)))
        elapsed = time.perf_counter() - start
        # Freed outside the timed region: a server frees contexts after answering.
        await asyncio.gather(*(self.engine.free_context(c) for c in ids))
        return elapsed, list(outputs)

    def context_ids(self, n: int) -> list[int]:
        """``n`` context ids never used before in this run (the engine rejects a live id)."""
        return [next(self._ids) for _ in range(n)]

    def call(self, coro: Any) -> Any:
        """Run a coroutine that talks to the engine on this runner's event loop."""
        return self._loop.run_until_complete(coro)

    def close(self) -> None:
        self._loop.close()


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


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


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


def model_record(model: str, engine: LLMEngine) -> dict[str, Any]:
    """What ran, for a results file, without paths of this machine: the name as given (a file's stem for a
    path), the weights file's name and size (a folder's: its files'), the config and parameter count."""
    path = resolve_model(model).path
    files = [] if path is None else [path] if path.is_file() else [f for f in path.iterdir() if f.is_file()]
    return {
        "name": resolve_model(model).name,
        "file": None if path is None else path.name,
        "file_bytes": None if path is None else sum(f.stat().st_size for f in files),
        "config": asdict(engine.model_config),
        "parameters": sum(p.numel() for p in engine_model(engine).parameters()),
    }


# ------------------------------------------------------------------------------------------ process groups
GRACE_S = 3.0  # from SIGTERM to SIGKILL of a worker's group
_groups: dict[int, subprocess.Popen[str]] = {}  # live groups by id (= the leader's pid)
_replaced: dict[int, Any] = {}  # the signal handlers ours replaced while a group lives


def start_group(command: Sequence[str], **popen: Any) -> subprocess.Popen[str]:
    """``command`` as the leader of a new session: a process group its children join (unless they leave
    it), stopped whole by `stop_group` — or when this process exits or gets SIGTERM or SIGINT first, which
    would otherwise leave the children orphaned."""
    proc = subprocess.Popen(list(command), start_new_session=True, text=True, **popen)
    if not _groups and threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGTERM, signal.SIGINT):
            _replaced[signum] = signal.signal(signum, _on_signal)
    _groups[proc.pid] = proc
    return proc


def stop_group(proc: subprocess.Popen[str], grace_s: float = GRACE_S) -> None:
    """SIGTERM to every process of ``proc``'s group, SIGKILL to whatever is left after ``grace_s``; the
    leader reaped. Nothing to do for a group already gone."""
    _groups.pop(proc.pid, None)
    if not _groups:
        _restore_handlers()
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            proc.poll()  # reap the leader: a zombie still counts as a member of the group
            os.killpg(proc.pid, 0)  # ProcessLookupError once no member is left
            time.sleep(0.02)
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _restore_handlers() -> None:
    for signum, handler in _replaced.items():
        signal.signal(signum, handler)
    _replaced.clear()


def _stop_all() -> None:
    for proc in list(_groups.values()):
        stop_group(proc)


def _on_signal(signum: int, frame: FrameType | None) -> None:
    """Stop every group, then let the signal do what it did before (SIGINT: KeyboardInterrupt)."""
    previous = _replaced.get(signum, signal.SIG_DFL)
    _stop_all()
    if callable(previous):
        previous(signum, frame)
    elif previous == signal.SIG_DFL:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


atexit.register(_stop_all)


# ----------------------------------------------------------------------------------------------- vLLM
class VLLMWorker:
    """vLLM's ``LLM.generate`` in a worker process (`benchmarks/vllm_worker.py`) of another interpreter.

    The worker loads the model once, then times each batch itself (JSON lines over its stdin / stdout), so
    the pipe is not in the figures. Its log goes to our stderr. It leads its own process group
    (`start_group`), so vLLM's engine processes go with it whatever ends the run.
    """

    name = "vllm"

    def __init__(
        self,
        python: str,
        folder: Path,
        *,
        dtype: str,
        max_model_len: int,
        max_num_seqs: int,
        engine_args: dict[str, Any] | None = None,
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
        script: Path | None = None,  # default: WORKER_SCRIPT
        load_timeout_s: float = 3600.0,
        request_timeout_s: float = 3600.0,
    ) -> None:
        command = [python, str(script or WORKER_SCRIPT), "--model", str(folder), "--dtype", dtype]
        command += ["--max-model-len", str(max_model_len), "--max-num-seqs", str(max_num_seqs)]
        command += ["--engine-args", json.dumps(engine_args or {})]
        self.request_timeout_s = request_timeout_s
        self._proc = start_group(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, cwd=cwd)
        # Replies are read on a thread into a queue, so every wait can time out (a hung worker must not
        # hang the benchmark) and a worker that dies shows up as the end of its output.
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._pump, name="vllm-worker-reader", daemon=True)
        self._reader.start()
        try:
            hello = self._receive(load_timeout_s)
        except BaseException:
            self.close()
            raise
        if not hello.get("ready"):
            self.close()
            raise RuntimeError(f"the vLLM worker could not load the model: {hello.get('error')}")
        self.info: dict[str, Any] = hello

    def run(self, prompts: Sequence[list[int]], max_new_tokens: int) -> tuple[float, Outputs]:
        reply = self.request(
            {"op": "generate", "prompts": [list(p) for p in prompts], "max_tokens": max_new_tokens}
        )
        return float(reply["seconds"]), [list(t) for t in reply["token_ids"]]

    def request(self, message: dict[str, Any], timeout_s: float | None = None) -> dict[str, Any]:
        """Send one request and return its successful reply (RuntimeError for an error reply)."""
        stdin = self._proc.stdin
        assert stdin is not None
        try:
            stdin.write(json.dumps(message) + "\n")
            stdin.flush()
        except (BrokenPipeError, OSError, ValueError) as e:  # ValueError: the pipe is closed
            raise RuntimeError(f"the vLLM worker is gone (exit code {self._proc.poll()}): {e}") from e
        reply = self._receive(self.request_timeout_s if timeout_s is None else timeout_s)
        if not reply.get("ok"):
            raise RuntimeError(f"the vLLM worker failed {message.get('op')!r}: {reply.get('error')}")
        return reply

    def close(self) -> None:
        """Ask the worker to quit (it shuts its engine processes down), then stop its group: whatever of
        it is left, or all of it where the worker does not answer."""
        if self._proc.poll() is None:
            with contextlib.suppress(RuntimeError, TimeoutError, subprocess.TimeoutExpired):
                self.request({"op": "quit"}, timeout_s=60)
                self._proc.wait(timeout=60)
        stop_group(self._proc)
        # The reader has seen the end of the output once the process is gone; only then close its pipe.
        self._reader.join(timeout=10)
        for stream in (self._proc.stdin, self._proc.stdout):
            if stream is not None and not (stream is self._proc.stdout and self._reader.is_alive()):
                stream.close()

    def _pump(self) -> None:
        stdout = self._proc.stdout
        assert stdout is not None
        try:
            for line in stdout:
                if line.strip():
                    self._lines.put(line)
        except ValueError:  # closed by `close` while reading
            pass
        self._lines.put(None)

    def _receive(self, timeout_s: float) -> dict[str, Any]:
        try:
            line = self._lines.get(timeout=timeout_s)
        except queue.Empty:
            raise TimeoutError(f"no answer from the vLLM worker within {timeout_s:.0f}s") from None
        if line is None:
            self._lines.put(None)  # stay at end of output for any later read
            raise RuntimeError(
                f"the vLLM worker exited (code {self._proc.wait()}); its log is above, on stderr"
            )
        try:
            reply = json.loads(line)
        except json.JSONDecodeError:
            raise RuntimeError(f"the vLLM worker wrote a line that is not JSON: {line[:200]!r}") from None
        if not isinstance(reply, dict):
            raise RuntimeError(f"the vLLM worker wrote {reply!r}, not a JSON object")
        return reply


def cpu_list(cpus: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"`` (the form of ``VLLM_CPU_OMP_THREADS_BIND``)."""
    runs: list[list[int]] = []
    for cpu in sorted(set(cpus)):
        if runs and cpu == runs[-1][-1] + 1:
            runs[-1].append(cpu)
        else:
            runs.append([cpu])
    return ",".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs)


def kv_cache_gib(model_config: Any, dtype: str, tokens: int) -> int:
    """Whole GiB of KV cache that hold ``tokens`` tokens in ``dtype``, with room for block rounding."""
    itemsize = getattr(torch, dtype).itemsize
    per_token = 2 * model_config.num_hidden_layers * model_config.num_key_value_heads * model_config.head_dim
    return max(1, math.ceil(1.25 * tokens * per_token * itemsize / (1 << 30)))


def vllm_env(
    model_config: Any, dtype: str, max_model_len: int, max_num_seqs: int, extra: Sequence[str] = ()
) -> dict[str, str]:
    """The vLLM worker's environment: ours, with the CPU settings that make the comparison even.

    Defaults only where our environment does not set them; ``extra`` (``KEY=VALUE``) always wins. Our
    ``PYTHONPATH`` is dropped: it points at this repository, whose ``kernels`` package would shadow the
    Hugging Face ``kernels`` package that transformers looks for in the worker's environment.
    """
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    cores = cores or list(range(os.cpu_count() or 1))
    defaults = {
        # As many OpenMP threads, on the same cores, as our process computes with; no core kept back for
        # vLLM's scheduler (its "auto" would keep one of two).
        "VLLM_CPU_OMP_THREADS_BIND": cpu_list(cores[: torch.get_num_threads()]),
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib(model_config, dtype, max_model_len * max_num_seqs)),
        "VLLM_LOGGING_LEVEL": "WARNING",
    }
    for key, value in defaults.items():
        env.setdefault(key, value)
    for item in extra:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--vllm-env expects KEY=VALUE, got {item!r}")
        env[key] = value
    return env


def add_vllm_flags(parser: argparse.ArgumentParser) -> None:
    """``--vllm-python`` (default ``$PARROT_VLLM_PYTHON``, which the runner passes through), ``--vllm-dtype``,
    ``--vllm-engine-args`` and ``--vllm-env``: what `start_vllm` reads."""
    g = parser.add_argument_group("vLLM", "vLLM side by side (needs an interpreter that has vllm)")
    g.add_argument(
        "--vllm-python",
        metavar="PATH",
        default=os.environ.get("PARROT_VLLM_PYTHON") or None,
        help="python of a virtualenv with vLLM installed (default: $PARROT_VLLM_PYTHON)",
    )
    g.add_argument(
        "--vllm-dtype", choices=DTYPES, help="vLLM's dtype (default: bf16 where native, else fp32)"
    )
    g.add_argument(
        "--vllm-engine-args", metavar="JSON", type=_json_object, default={}, help="vllm.LLM kwargs"
    )
    g.add_argument("--vllm-env", metavar="KEY=VALUE", action="append", default=[], help="for the worker only")


def _json_object(text: str) -> dict[str, Any]:
    value = json.loads(text)
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object, e.g. '{\"enforce_eager\": true}'")
    return value


def start_vllm(
    args: argparse.Namespace,
    folder: Path,
    engine: LLMEngine,
    max_model_len: int,
    max_num_seqs: int,
    workdir: Path,
) -> VLLMWorker | None:
    """The vLLM worker of `add_vllm_flags` on ``folder`` (our weights), sized for ``max_num_seqs``
    requests of ``max_model_len`` tokens, run in ``workdir``; None without ``--vllm-python``."""
    if not args.vllm_python:
        return None
    dtype = args.vllm_dtype or ("bfloat16" if cpu_has_native_bf16() else "float32")
    log(f"starting vLLM ({args.vllm_python}, {dtype}) on {folder} ...")
    env = vllm_env(engine.model_config, dtype, max_model_len, max_num_seqs, args.vllm_env)
    worker = VLLMWorker(
        args.vllm_python,
        folder,
        dtype=dtype,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        engine_args=args.vllm_engine_args,
        env=env,
        cwd=workdir,
    )
    # Where the weights lay on this machine (a temporary folder) tells a reader of the results nothing.
    worker.info["llm_kwargs"] = {**worker.info.get("llm_kwargs", {}), "model": folder.name}
    log(f"vLLM {worker.info.get('vllm')} ready in {worker.info.get('load_s', math.nan):.0f}s")
    return worker


# ----------------------------------------------------------------------------------------------- timing
@dataclass(frozen=True)
class Rate:
    """A rate computed from the median times, and the rates of each repeat's own times around it."""

    value: float
    per_repeat: list[float]

    @property
    def spread(self) -> Spread:
        return Spread.of(self.per_repeat)

    @property
    def rel_half_range(self) -> float:
        """Half the per-repeat range relative to the value (``±`` in the tables)."""
        return safe_ratio(self.spread.hi - self.spread.lo, 2 * abs(self.value))

    def over(self, other: Rate) -> Ratio:
        """This rate over ``other``'s: of the values, and the range of the ratios repeat by repeat."""
        pairs = zip(self.per_repeat, other.per_repeat, strict=False)
        per_repeat = Spread.of(safe_ratio(a, b) for a, b in pairs)
        return Ratio(safe_ratio(self.value, other.value), per_repeat.lo, per_repeat.hi)


@dataclass
class Rates:
    """One system at one batch size: ``T(1)`` and ``T(N)`` per repeat (seconds) and the rates from them."""

    t_first: list[float]
    t_full: list[float]
    prefill_tps: Rate  # prompt tokens / T(1)
    decode_tps: Rate  # B (N - 1) / (T(N) - T(1))
    e2e_tps: Rate  # B N / T(N)

    @classmethod
    def of(
        cls, t_first: list[float], t_full: list[float], prompt_tokens: int, batch: int, new_tokens: int
    ) -> Rates:
        """Rates from the medians of the times (robust to one slow repeat); ranges from each repeat alone."""
        t1, tn = Spread.of(t_first).median, Spread.of(t_full).median
        decode = batch * (new_tokens - 1)
        pairs = zip(t_first, t_full, strict=True)
        return cls(
            t_first,
            t_full,
            Rate(safe_ratio(prompt_tokens, t1), [safe_ratio(prompt_tokens, t) for t in t_first]),
            Rate(
                safe_ratio(decode, tn - t1),
                [safe_ratio(decode, b - a) if b > a else math.nan for a, b in pairs],
            ),
            Rate(safe_ratio(batch * new_tokens, tn), [safe_ratio(batch * new_tokens, t) for t in t_full]),
        )

    def times(self) -> str:
        """The median ``T(1) / T(N)`` in seconds (for a table cell)."""
        return f"{Spread.of(self.t_first).median:.3f} / {Spread.of(self.t_full).median:.3f}"


@dataclass
class Timed:
    """Every system's rates at one batch, the outputs of its last run, the repeats done."""

    rates: dict[str, Rates]
    outputs: dict[str, Outputs]
    repeats: int


def time_batch(
    systems: Sequence[Generator],
    prompts: Sequence[list[int]],
    new_tokens: int,
    repeats: int,
    min_time_s: float,
) -> Timed:
    """A warm-up run of every system, then ``T(1)`` and ``T(N)`` of each, interleaved, repeat after repeat.

    At least ``repeats`` repeats, more (up to 3x) while less than ``min_time_s`` was spent: small batches
    are cheap and the noisiest relative to their length, so they get more samples.
    """
    times: dict[str, tuple[list[float], list[float]]] = {s.name: ([], []) for s in systems}
    outputs: dict[str, Outputs] = {}
    for system in systems:  # warm-up: one-time allocations, workspaces, lazy imports, compiled shapes
        system.run(prompts, new_tokens)
    started, rep = time.perf_counter(), 0
    while rep < repeats or (rep < 3 * repeats and time.perf_counter() - started < min_time_s):
        # In order, then reversed: a slow drift of the machine hits every system alike, and each pair of
        # neighbours swaps who goes first.
        for system in systems if rep % 2 == 0 else systems[::-1]:
            # Untimed: the first HF run after our engine ran pays ~1.5-2 s extra at batch 64 (it goes away
            # with MALLOC_MMAP_THRESHOLD_ pinned, so it looks like glibc returning memory that the big padded
            # tensors then fault in again) — a cost an HF user running HF alone never sees, which would
            # otherwise land entirely in T(1) and inflate HF's decode rate.
            system.run(prompts, 1)
            t1, _ = system.run(prompts, 1)
            tn, outputs[system.name] = system.run(prompts, new_tokens)
            times[system.name][0].append(t1)
            times[system.name][1].append(tn)
        rep += 1
        line = " | ".join(f"{n} T(1)={t[0][-1]:.3f}s T(N)={t[1][-1]:.3f}s" for n, t in times.items())
        log(f"  b{len(prompts)} repeat {rep}: {line}")
    prompt_tokens = sum(len(p) for p in prompts)
    rates = {n: Rates.of(*t, prompt_tokens, len(prompts), new_tokens) for n, t in times.items()}
    return Timed(rates, outputs, rep)


# ----------------------------------------------------------------------------------------------- ceiling
def decode_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of weights one batch-1 decode step reads: every parameter once (a tied embedding is the
    output head's matrix, read whole), except an untied embedding table, of which it reads one row."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())  # shared tensors once
    cfg = getattr(model, "config", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if embed is not None and not getattr(cfg, "tie_word_embeddings", True):
        weight = embed.weight
        total -= weight.numel() * weight.element_size() - weight.shape[1] * weight.element_size()
    return total


@dataclass
class Ceiling:
    """The batch-1 decode rate memory bandwidth allows, and a measured rate against it."""

    read_bytes_per_s: float  # median memory read bandwidth (see `benchmarks.common.memory_bandwidth`)
    weight_bytes: int  # read per decode step (`decode_weight_bytes`)
    dtype: str
    ceiling_tps: float  # read_bytes_per_s / weight_bytes
    decode_b1_tps: float  # the measured batch-1 decode rate (NaN: not measured)
    share: float  # decode_b1_tps / ceiling_tps
    bandwidth: dict[str, float | int]


def decode_ceiling(
    bandwidth: dict[str, float | int], model: torch.nn.Module, dtype: str, decode_b1_tps: float
) -> Ceiling:
    """``decode_b1_tps`` against memory bandwidth (`benchmarks.common.memory_bandwidth`) / the weight
    bytes one step of ``model`` reads."""
    read, weights = float(bandwidth["read_bytes_per_s"]), decode_weight_bytes(model)
    ceiling = safe_ratio(read, weights)
    return Ceiling(
        read, weights, dtype, ceiling, decode_b1_tps, safe_ratio(decode_b1_tps, ceiling), bandwidth
    )
