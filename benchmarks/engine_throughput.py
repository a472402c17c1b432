"""Engine throughput: our paged-KV engine vs Hugging Face ``generate`` (and vLLM) on the same model, one run.

Measured at batch 1, 16 and 64 with the same prompts (stdlib docstrings, lengths spread over
``[spread * L, L]``), greedy, the same number of new tokens, on CPU; our engine in its default dtype (fp32
on CPU) or ``--dtype``, HF in the same dtype, vLLM in ``--vllm-dtype`` (bf16 by default); the output
states each:

* **prefill tok/s** = prompt tokens / ``T(1)``, where ``T(1)`` is the wall time from submitting the batch to
  having the first generated token of every request (ours: ``fill`` + ``generate(max_tokens=1)`` per request,
  all at once; HF: ``generate(max_new_tokens=1)`` over the left-padded batch). Prompt tokens are the real,
  unpadded ones for both systems, so the padding HF computes counts against it.
* **decode tok/s** = ``B * (N - 1) / (T(N) - T(1))``: the generated tokens after the first, over the time the
  run with ``N`` new tokens takes beyond the prefill-only run. Same definition for both systems; with
  continuous batching, prefill and decode of different requests overlap, and this charges decode with
  exactly the extra time that producing the other ``N - 1`` tokens costs.
* **end-to-end tok/s** = ``B * N / T(N)`` (generated tokens over the whole run).

``T(1)`` and ``T(N)`` are medians over at least ``--repeats`` runs (small batches get more, up to 3x,
within a time budget), the systems interleaved (in order, then reversed, repeat after repeat), each
system's pair of timed runs preceded by an untimed prefill-only run (see `measure_batch`), after one full
warm-up run of each; the spread (``±``) is half the range of the per-repeat figures. HF is what a Hugging
Face user runs: ``LlamaForCausalLM.from_pretrained(folder)``, left padding with an attention mask,
``generate(do_sample=False, min_new_tokens=N, max_new_tokens=N)`` (its default cache and attention).

vLLM (``--vllm-python PATH``: an interpreter of a separate virtualenv with vLLM, e.g. its CPU build) is
``LLM.generate`` over the same token ids (``TokensPrompt``), greedy, ``min_tokens = max_tokens = N``,
``ignore_eos``, token ids out, automatic prefix caching off (T(1) and T(N) run the same prompts; ours and
HF recompute every prompt too), otherwise vLLM's defaults. It runs in a long-lived worker process
(``benchmarks/vllm_worker.py``: the model is loaded once per run) whose ``generate`` calls are timed inside
the worker. Unless set in the environment (or with ``--vllm-env``), the worker's OpenMP threads are bound
to the cores and thread count our process uses (``VLLM_CPU_OMP_THREADS_BIND``, no core reserved:
``VLLM_CPU_NUM_OF_RESERVED_CPU=0``, where vLLM's ``auto`` would keep one of two cores for its scheduler),
its KV cache (``VLLM_CPU_KVCACHE_SPACE``) fits the largest batch, and its log level is WARNING. vLLM's CPU
docs recommend ``LD_PRELOAD`` of tcmalloc and Intel OpenMP; pass it with ``--vllm-env LD_PRELOAD=...``.

Batch-1 decode ceiling: decoding one token streams every weight from memory once (the embedding table only
where it is tied to the output head), so main-memory read bandwidth (`benchmarks.common.memory_bandwidth`:
a matrix-vector product or a ``sum`` over 256 MiB, the better median of repeats, measured in the same run)
/ weight bytes of our model in its dtype bounds batch-1 decode tok/s; ours is reported as a share of it.

Without a Hugging Face folder (``--model`` a GGUF file or a name our engine resolves), the weights our engine
loaded are exported to a temporary HF folder (`benchmarks.common.export_hf_folder`), so HF and vLLM run
exactly our weights.

KV memory: 32 requests sharing a 2048-token prefix plus a distinct 16-token suffix each, generating a few
tokens, counted exactly (``engine.stats().blocks_used`` with every context still alive) with fork (the prefix
filled once, 32 children forked from it) and without (32 independent fills of prefix + suffix).

    python -m benchmarks.engine_throughput [--quick] [--json PATH] [--model PATH] [--repeats N]
        [--dtype D] [--vllm-python PATH [--vllm-dtype D] [--vllm-engine-args JSON] [--vllm-env K=V ...]]
    (or python benchmarks/engine_throughput.py ...)

The last line is ``RESULT engine_throughput decode_ratio_b1=... prefill_ratio_b64=... kv_fork_ratio=...
mem_bw_gbs=... decode_b1_pct_ceiling=...`` (ours/HF ratios), with ``decode_vs_vllm_b1=...`` (ours/vLLM)
and the like when vLLM ran.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import math
import os
import queue
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

if not __package__:
    # Run as a file, this script's directory would come first on sys.path (where `benchmarks/kernels.py`
    # shadows the `kernels` package); put the repository root there instead.
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from benchmarks.common import (
    Spread,
    add_engine_flags,
    add_size_flags,
    engine_model,
    export_hf_folder,
    fmt_num,
    load_average,
    log,
    machine_info,
    markdown_table,
    memory_bandwidth,
    result_line,
    safe_ratio,
    set_threads,
    sized,
    stdlib_text,
    write_json,
)
from server.engine import EngineConfig, LLMEngine, SamplingParams
from server.engine.config import cpu_has_native_bf16

NAME = "engine_throughput"
WORKER_SCRIPT = Path(__file__).resolve().with_name("vllm_worker.py")
DTYPES = ("float32", "float16", "bfloat16")


@dataclass(frozen=True)
class BenchConfig:
    """What one run measures."""

    batches: tuple[int, ...] = (1, 16, 64)
    prompt_len: int = 512  # the longest prompt; the others are spread down to `spread * prompt_len`
    spread: float = 0.5
    max_new_tokens: int = 128
    repeats: int = 5  # at least; small batches get more (see `measure_batch`)
    min_time_s: float = 20.0  # timed seconds per batch size before the repeats may stop
    kv_requests: int = 32
    kv_prefix: int = 2048
    kv_suffix: int = 16
    kv_new_tokens: int = 8
    max_num_batched_tokens: int = 2048  # the engine's default token budget per step
    seed: int = 0
    bandwidth_mib: int = 256  # the tensor the memory bandwidth is measured on (far larger than any cache)
    bandwidth_repeats: int = 9


FULL = BenchConfig()
QUICK = BenchConfig(prompt_len=64, max_new_tokens=16, repeats=3, min_time_s=1.5)
TINY = BenchConfig(
    batches=(1, 4),
    prompt_len=16,
    max_new_tokens=4,
    repeats=1,
    min_time_s=0.0,
    kv_requests=4,
    kv_prefix=64,
    bandwidth_mib=16,
    bandwidth_repeats=3,
)


# ----------------------------------------------------------------------------------------------- systems
class System(Protocol):
    """A way to run a batch of greedy generations; every system is driven through this."""

    name: str

    def run(self, prompts: Sequence[list[int]], max_new_tokens: int) -> tuple[float, list[list[int]]]:
        """Generate ``max_new_tokens`` greedily for every prompt at once; return (seconds, token ids)."""
        ...


class OurEngine:
    """Our engine, driven as the manager drives it: per request a fill then a generate, all concurrent."""

    name = "ours"

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        # One event loop for the whole run: results come back into it from the engine thread.
        self._loop = asyncio.new_event_loop()
        self._ids = itertools.count(1)

    def run(self, prompts: Sequence[list[int]], max_new_tokens: int) -> tuple[float, list[list[int]]]:
        return self.call(self._run(prompts, max_new_tokens))

    async def _run(self, prompts: Sequence[list[int]], max_new_tokens: int) -> tuple[float, list[list[int]]]:
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
    """``transformers`` ``generate`` over a left-padded batch with an attention mask."""

    name = "hf"

    def __init__(self, model: Any, pad_token_id: int) -> None:
        self.model = model
        self.pad_token_id = pad_token_id

    def run(self, prompts: Sequence[list[int]], max_new_tokens: int) -> tuple[float, list[list[int]]]:
        input_ids, mask = left_pad(prompts, self.pad_token_id)
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
        elapsed = time.perf_counter() - start
        return elapsed, out[:, input_ids.shape[1] :].tolist()


def left_pad(prompts: Sequence[list[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and attention mask of a left-padded batch (how decoder-only models are batched in HF)."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p) :] = 1
    return ids, mask


class VLLMWorker:
    """vLLM's ``LLM.generate`` in a worker process (`benchmarks/vllm_worker.py`) of another interpreter.

    The worker loads the model once, then times each batch itself (JSON lines over its stdin / stdout), so
    the pipe is not in the figures. Its log goes to our stderr.
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
        command = [
            python,
            str(script or WORKER_SCRIPT),
            "--model",
            str(folder),
            "--dtype",
            dtype,
            "--max-model-len",
            str(max_model_len),
            "--max-num-seqs",
            str(max_num_seqs),
            "--engine-args",
            json.dumps(engine_args or {}),
        ]
        self.request_timeout_s = request_timeout_s
        # Its own session: vLLM starts engine processes under it, and a worker that must be killed is
        # killed with them (a worker that loses us sees its stdin close and quits by itself).
        self._proc = subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
            cwd=cwd,
            start_new_session=True,
        )
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

    def run(self, prompts: Sequence[list[int]], max_new_tokens: int) -> tuple[float, list[list[int]]]:
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
        except (BrokenPipeError, OSError) as e:
            raise RuntimeError(f"the vLLM worker is gone (exit code {self._proc.poll()}): {e}") from e
        reply = self._receive(self.request_timeout_s if timeout_s is None else timeout_s)
        if not reply.get("ok"):
            raise RuntimeError(f"the vLLM worker failed {message.get('op')!r}: {reply.get('error')}")
        return reply

    def close(self) -> None:
        """Ask the worker to quit (it shuts its engine processes down), kill it if it does not."""
        if self._proc.poll() is None:
            try:
                self.request({"op": "quit"}, timeout_s=60)
                self._proc.wait(timeout=60)
            except (RuntimeError, TimeoutError, subprocess.TimeoutExpired):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self._proc.pid, signal.SIGKILL)
                self._proc.wait()
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
    parts: list[str] = []
    ordered = sorted(set(cpus))
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        parts.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(parts)


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
    cores = (
        sorted(os.sched_getaffinity(0))
        if hasattr(os, "sched_getaffinity")
        else list(range(os.cpu_count() or 1))
    )
    defaults = {
        # As many OpenMP threads, on the same cores, as our process computes with.
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


# ----------------------------------------------------------------------------------------------- workload
def make_prompts(tokens: list[int], batch: int, max_len: int, spread: float, seed: int) -> list[list[int]]:
    """``batch`` prompts cut from the token stream at distinct offsets, lengths uniform in the spread."""
    rng = random.Random(f"{seed}-{batch}-{max_len}")  # a string seed: the same prompts on every run
    lo = max(1, round(spread * max_len))
    prompts = []
    for _ in range(batch):
        n = rng.randint(lo, max_len)
        start = rng.randrange(0, len(tokens) - n)
        prompts.append(tokens[start : start + n])
    return prompts


def tokenize_text(tokenizer: Any, min_tokens: int) -> list[int]:
    """The stdlib workload text as token ids (no special tokens), at least ``min_tokens`` of them."""
    chars = 4 * min_tokens
    while True:
        ids = tokenizer(stdlib_text(chars), add_special_tokens=False).input_ids
        if len(ids) >= min_tokens:
            return list(ids)
        chars *= 2


# ----------------------------------------------------------------------------------------------- throughput
@dataclass(frozen=True)
class Rate:
    """A rate computed from the median times, with the range of the per-repeat rates around it."""

    value: float
    lo: float
    hi: float

    @classmethod
    def around(cls, value: float, per_repeat: list[float]) -> Rate:
        spread = Spread.of(per_repeat)
        return cls(value, spread.lo, spread.hi)

    @property
    def rel_half_range(self) -> float:
        """Half the per-repeat range relative to the value (``±`` in the table)."""
        return safe_ratio(self.hi - self.lo, 2 * abs(self.value))


@dataclass
class SystemResult:
    """One system at one batch size: raw times per repeat and the rates derived from them."""

    t_first: list[float]  # T(1) per repeat, seconds
    t_full: list[float]  # T(N) per repeat, seconds
    prefill_tps: Rate
    decode_tps: Rate
    e2e_tps: Rate


def summarize(
    t_first: list[float], t_full: list[float], prompt_tokens: int, batch: int, new_tokens: int
) -> SystemResult:
    """Rates from the medians of the times (robust to one slow repeat); the range from each repeat alone."""
    t1, tn = Spread.of(t_first).median, Spread.of(t_full).median
    decode_tokens = batch * (new_tokens - 1)
    per_rep_decode = [
        safe_ratio(decode_tokens, b - a) if b > a else math.nan for a, b in zip(t_first, t_full, strict=True)
    ]
    return SystemResult(
        t_first=t_first,
        t_full=t_full,
        prefill_tps=Rate.around(prompt_tokens / t1, [prompt_tokens / t for t in t_first]),
        decode_tps=Rate.around(safe_ratio(decode_tokens, tn - t1), per_rep_decode),
        e2e_tps=Rate.around(batch * new_tokens / tn, [batch * new_tokens / t for t in t_full]),
    )


@dataclass
class BatchResult:
    """Every system at one batch size, plus checks that the comparison is sound."""

    batch: int
    prompt_tokens: int  # real prompt tokens (what every system is credited with)
    padded_tokens: int  # what HF's left-padded batch computes
    new_tokens: int
    ours: SystemResult
    hf: SystemResult
    greedy_agreement: float  # share of requests whose tokens are identical in ours and HF
    engine_prefill_tokens_per_run: float  # sanity: ours computes each prompt token once (no recompute)
    engine_preemptions: int
    repeats: int
    vllm: SystemResult | None = None  # with --vllm-python
    vllm_agreement: float | None = None  # share of requests whose tokens are identical in ours and vLLM


def measure_batch(
    ours: OurEngine,
    hf: HFGenerate,
    prompts: list[list[int]],
    new_tokens: int,
    cfg: BenchConfig,
    vllm: System | None = None,
) -> BatchResult:
    """Warm up, then time ``T(1)`` and ``T(N)`` for every system, interleaved, repeat after repeat.

    At least ``cfg.repeats`` repeats, more (up to 3x) while less than ``cfg.min_time_s`` was spent: small
    batches are cheap and the noisiest relative to their length, so they get more samples.
    """
    batch = len(prompts)
    systems: list[System] = [ours, hf] + ([vllm] if vllm is not None else [])
    times: dict[str, tuple[list[float], list[float]]] = {s.name: ([], []) for s in systems}
    outputs: dict[str, list[list[int]]] = {}
    for system in systems:  # warm-up: one-time allocations, workspaces, lazy imports, compiled shapes
        system.run(prompts, new_tokens)
    before = ours.engine.stats()
    started, rep = time.perf_counter(), 0
    while rep < cfg.repeats or (rep < 3 * cfg.repeats and time.perf_counter() - started < cfg.min_time_s):
        # In order, then reversed: a slow drift of the machine hits every system alike, and each pair of
        # neighbours swaps who goes first.
        order = systems if rep % 2 == 0 else systems[::-1]
        for system in order:
            # Untimed: the first HF run after our engine ran pays ~1.5-2 s extra at batch 64 (it goes away
            # with MALLOC_MMAP_THRESHOLD_ pinned, so it looks like glibc returning memory that the big padded
            # tensors then fault in again) — a cost an HF user running HF alone never sees, which would
            # otherwise land entirely in T(1) and inflate HF's decode rate.
            system.run(prompts, 1)
            t1, _ = system.run(prompts, 1)
            tn, out = system.run(prompts, new_tokens)
            times[system.name][0].append(t1)
            times[system.name][1].append(tn)
            outputs[system.name] = out
        rep += 1
        log(
            f"  b{batch} repeat {rep}: "
            + " | ".join(f"{name} T(1)={t[0][-1]:.3f}s T(N)={t[1][-1]:.3f}s" for name, t in times.items())
        )
    after = ours.engine.stats()
    prompt_tokens = sum(len(p) for p in prompts)
    summary = {name: summarize(*t, prompt_tokens, batch, new_tokens) for name, t in times.items()}

    def agreement(other: str) -> float:
        return sum(a == b for a, b in zip(outputs[ours.name], outputs[other], strict=True)) / batch

    return BatchResult(
        batch=batch,
        prompt_tokens=prompt_tokens,
        padded_tokens=batch * max(len(p) for p in prompts),
        new_tokens=new_tokens,
        ours=summary[ours.name],
        hf=summary[hf.name],
        greedy_agreement=agreement(hf.name),
        engine_prefill_tokens_per_run=(after.prefill_tokens_computed - before.prefill_tokens_computed)
        / (3 * rep),
        engine_preemptions=after.preemptions - before.preemptions,
        repeats=rep,
        vllm=summary[vllm.name] if vllm is not None else None,
        vllm_agreement=agreement(vllm.name) if vllm is not None else None,
    )


# ----------------------------------------------------------------------------------------------- KV memory
@dataclass
class KVMode:
    """One way of serving the shared-prefix requests: blocks in use (measured and predicted), work done."""

    blocks_used: int
    blocks_expected: int
    prefill_tokens_computed: int
    seconds: float
    blocks_after_free: int
    grouped_decode_steps: int  # decode steps that read the shared prefix once for the whole group


@dataclass
class KVResult:
    """The shared-prefix requests served with and without fork."""

    requests: int
    prefix_tokens: int
    suffix_tokens: int
    new_tokens: int
    block_size: int
    fork: KVMode
    no_fork: KVMode

    @property
    def ratio(self) -> float:
        return safe_ratio(self.no_fork.blocks_used, self.fork.blocks_used)


def blocks(n_tokens: int, block_size: int) -> int:
    """Blocks that hold ``n_tokens`` tokens."""
    return -(-n_tokens // block_size)


async def measure_kv(
    engine: LLMEngine, ids: list[int], prefix: list[int], suffixes: list[list[int]], new_tokens: int
) -> KVResult:
    """Blocks in use for the shared-prefix requests with and without fork, every context still alive."""
    bs = engine.block_size
    sampling = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    n, p, s = len(suffixes), len(prefix), len(suffixes[0])
    # After a generate of G tokens a context holds P+S+G tokens; the last sampled one is never computed,
    # so P+S+G-1 tokens have KV. A fork shares the parent's full blocks and copies a partial last one.
    cached = p + s + new_tokens - 1
    expected_no_fork = n * blocks(cached, bs)
    expected_fork = blocks(p, bs) + n * (blocks(cached, bs) - p // bs)

    # ids: n for the independent contexts, then the prefix context and its n children.
    alone, root, children = ids[:n], ids[n], ids[n + 1 : 2 * n + 1]

    async def no_fork() -> list[int]:
        async def one(cid: int, suffix: list[int]) -> None:
            await engine.fill(cid, prefix + suffix)
            await engine.generate(cid, sampling)

        await asyncio.gather(*(one(c, x) for c, x in zip(alone, suffixes, strict=True)))
        return alone

    async def fork() -> list[int]:
        await engine.fill(root, prefix)

        async def one(cid: int, suffix: list[int]) -> None:
            await engine.fill(cid, suffix, parent_context_id=root)
            await engine.generate(cid, sampling)

        await asyncio.gather(*(one(c, x) for c, x in zip(children, suffixes, strict=True)))
        return [root, *children]

    async def run(mode: Any, expected: int) -> KVMode:
        before = engine.stats()
        assert before.blocks_used == 0, f"{before.blocks_used} blocks in use before the KV measurement"
        start = time.perf_counter()
        ids = await mode()
        seconds = time.perf_counter() - start
        stats = engine.stats()
        for cid in ids:
            await engine.free_context(cid)
        return KVMode(
            blocks_used=stats.blocks_used,
            blocks_expected=expected,
            prefill_tokens_computed=stats.prefill_tokens_computed - before.prefill_tokens_computed,
            seconds=seconds,
            blocks_after_free=engine.stats().blocks_used,
            grouped_decode_steps=stats.grouped_decode_steps - before.grouped_decode_steps,
        )

    return KVResult(
        requests=n,
        prefix_tokens=p,
        suffix_tokens=s,
        new_tokens=new_tokens,
        block_size=bs,
        no_fork=await run(no_fork, expected_no_fork),
        fork=await run(fork, expected_fork),
    )


# ----------------------------------------------------------------------------------------------- loading
def load_models(model: str, engine_config: EngineConfig, workdir: Path) -> tuple[LLMEngine, Any, Path]:
    """Our engine, HF's ``LlamaForCausalLM`` on the same weights in the same dtype, and their HF folder."""
    engine = LLMEngine.from_pretrained(model, config=engine_config)
    try:
        folder = hf_folder(model, engine, workdir, engine_config.seed)
        hf = load_hf(folder, engine_config.torch_dtype())
    except BaseException:
        engine.shutdown()
        raise
    return engine, hf, folder


def hf_folder(model: str, engine: LLMEngine, workdir: Path, seed: int) -> Path:
    """A Hugging Face folder holding the weights our engine loaded, for the baselines to load.

    ``--model`` a folder: that folder. ``tiny``: the embedded model written out (the same deterministic
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
    """The batch-1 decode rate memory bandwidth allows, and ours against it."""

    read_bytes_per_s: float  # median memory read bandwidth (see `benchmarks.common.memory_bandwidth`)
    weight_bytes: int  # read per decode step (`decode_weight_bytes`), in our engine's dtype
    dtype: str
    ceiling_tps: float  # read_bytes_per_s / weight_bytes
    ours_b1_decode_tps: float  # NaN without batch 1
    share: float  # ours / ceiling
    bandwidth: dict[str, float | int]


def decode_ceiling(
    bandwidth: dict[str, float | int], weight_bytes: int, dtype: str, results: list[BatchResult]
) -> Ceiling:
    read = float(bandwidth["read_bytes_per_s"])
    ceiling = safe_ratio(read, weight_bytes)
    ours_b1 = next((r.ours.decode_tps.value for r in results if r.batch == 1), math.nan)
    return Ceiling(read, weight_bytes, dtype, ceiling, ours_b1, safe_ratio(ours_b1, ceiling), bandwidth)


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


# ----------------------------------------------------------------------------------------------- report
METRICS = (("prefill", "prefill_tps"), ("decode", "decode_tps"), ("end-to-end", "e2e_tps"))


def rate_cell(rate: Rate) -> str:
    return f"{fmt_num(rate.value)} ±{rate.rel_half_range:.0%}"


def throughput_table(results: list[BatchResult]) -> str:
    """Prefill, decode and end-to-end rates of every system per batch size, with ours over each."""
    with_vllm = any(r.vllm is not None for r in results)
    rows = []
    for r in results:
        for label, attr in METRICS:
            ours: Rate = getattr(r.ours, attr)
            hf: Rate = getattr(r.hf, attr)
            row = [str(r.batch), f"{label} tok/s", rate_cell(ours), rate_cell(hf)]
            if with_vllm:
                vllm = getattr(r.vllm, attr) if r.vllm is not None else Rate(math.nan, math.nan, math.nan)
                row.append(rate_cell(vllm))
            row.append(f"{safe_ratio(ours.value, hf.value):.2f}x")
            if with_vllm:
                row.append(f"{safe_ratio(ours.value, vllm.value):.2f}x")
            rows.append(row)
    headers = ["batch", "metric", "ours", "HF generate"] + (["vLLM"] if with_vllm else [])
    headers += ["ours/HF"] + (["ours/vLLM"] if with_vllm else [])
    return markdown_table(headers, rows, [True, False] + [True] * (len(headers) - 2))


def times_cell(system: SystemResult) -> str:
    return f"{Spread.of(system.t_first).median:.3f} / {Spread.of(system.t_full).median:.3f}"


def workload_table(results: list[BatchResult]) -> str:
    """What was run: tokens in and out, the median raw times, and whether the systems produced the same
    tokens as ours."""
    with_vllm = any(r.vllm is not None for r in results)
    rows = []
    for r in results:
        row = [
            str(r.batch),
            fmt_num(r.prompt_tokens),
            fmt_num(r.padded_tokens),
            str(r.new_tokens),
            times_cell(r.ours),
            times_cell(r.hf),
        ]
        if with_vllm:
            row.append(times_cell(r.vllm) if r.vllm is not None else "")
        row.append(f"{r.greedy_agreement:.0%}")
        if with_vllm:
            row.append(f"{r.vllm_agreement:.0%}" if r.vllm_agreement is not None else "")
        rows.append(row)
    headers = ["batch", "prompt tok", "HF padded", "new tok", "ours T(1) / T(N) s", "HF T(1) / T(N) s"]
    headers += (["vLLM T(1) / T(N) s"] if with_vllm else []) + ["same tokens HF"]
    headers += ["same tokens vLLM"] if with_vllm else []
    return markdown_table(headers, rows, [True] * len(headers))


def kv_table(kv: KVResult) -> str:
    """Exact block counts with and without fork, against the counts the paged design predicts."""
    rows = [
        [
            mode,
            fmt_num(m.blocks_used),
            fmt_num(m.blocks_expected),
            fmt_num(m.prefill_tokens_computed),
            f"{m.seconds:.2f}",
            str(m.grouped_decode_steps),
        ]
        for mode, m in (("without fork", kv.no_fork), ("with fork", kv.fork))
    ]
    rows.append(
        [
            "without / with",
            f"{kv.ratio:.2f}x",
            f"{safe_ratio(kv.no_fork.blocks_expected, kv.fork.blocks_expected):.2f}x",
            f"{safe_ratio(kv.no_fork.prefill_tokens_computed, kv.fork.prefill_tokens_computed):.2f}x",
            f"{safe_ratio(kv.no_fork.seconds, kv.fork.seconds):.2f}x",
            "",
        ]
    )
    return markdown_table(
        [
            "KV cache",
            "blocks used",
            "expected",
            "prefill tokens computed",
            "time s",
            "shared-prefix decode steps",
        ],
        rows,
        [False, True, True, True, True, True],
    )


def result_metrics(
    results: list[BatchResult], kv: KVResult, ceiling: Ceiling, total_s: float
) -> dict[str, float | int]:
    """The figures of the RESULT line: ours/HF ratios per batch size, the KV block counts, the batch-1
    decode ceiling, then (when vLLM ran) ours/vLLM ratios."""
    metrics: dict[str, float | int] = {}
    for kind in ("decode", "prefill", "e2e"):
        for r in results:
            ours: Rate = getattr(r.ours, f"{kind}_tps")
            hf: Rate = getattr(r.hf, f"{kind}_tps")
            metrics[f"{kind}_ratio_b{r.batch}"] = safe_ratio(ours.value, hf.value)
    metrics["kv_fork_ratio"] = kv.ratio
    metrics["kv_blocks_fork"] = kv.fork.blocks_used
    metrics["kv_blocks_nofork"] = kv.no_fork.blocks_used
    metrics["mem_bw_gbs"] = ceiling.read_bytes_per_s / 1e9
    metrics["decode_b1_ceiling_tps"] = ceiling.ceiling_tps
    metrics["decode_b1_pct_ceiling"] = 100 * ceiling.share
    for kind in ("decode", "prefill", "e2e"):
        for r in results:
            if r.vllm is not None:
                ours = getattr(r.ours, f"{kind}_tps")
                metrics[f"{kind}_vs_vllm_b{r.batch}"] = safe_ratio(
                    ours.value, getattr(r.vllm, f"{kind}_tps").value
                )
    metrics["total_s"] = total_s
    return metrics


# ----------------------------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_size_flags(parser, "short prompts and outputs, 3 repeats (~1 min)")
    add_engine_flags(parser)
    parser.add_argument("--repeats", type=int, help="least timed repeats per batch size (median)")
    parser.add_argument("--batches", type=int, nargs="+", help="batch sizes (default 1 16 64)")
    parser.add_argument("--prompt-len", type=int, help="longest prompt in tokens")
    parser.add_argument("--new-tokens", type=int, help="tokens generated per request")
    parser.add_argument("--spread", type=float, help="shortest prompt / longest prompt (1: all equal)")
    parser.add_argument(
        "--dtype", choices=DTYPES, help="our engine's dtype, and HF's (default: the engine's, fp32 on CPU)"
    )
    vllm = parser.add_argument_group("vLLM", "vLLM side by side (needs an interpreter that has vllm)")
    vllm.add_argument(
        "--vllm-python",
        metavar="PATH",
        default=os.environ.get("PARROT_VLLM_PYTHON") or None,
        help="python of a virtualenv with vLLM installed (default: $PARROT_VLLM_PYTHON, which the "
        "benchmark runner passes through)",
    )
    vllm.add_argument(
        "--vllm-dtype",
        choices=DTYPES,
        help="vLLM's dtype (default: bf16 where the CPU computes bf16 natively, else fp32, as ours)",
    )
    vllm.add_argument(
        "--vllm-engine-args",
        metavar="JSON",
        type=json.loads,
        default={},
        help="more vllm.LLM keyword arguments, e.g. '{\"enforce_eager\": true}'",
    )
    vllm.add_argument(
        "--vllm-env",
        metavar="KEY=VALUE",
        action="append",
        default=[],
        help="an environment variable for the vLLM worker only (repeatable), e.g. LD_PRELOAD=...",
    )
    args = parser.parse_args(argv)
    if not isinstance(args.vllm_engine_args, dict):
        parser.error("--vllm-engine-args must be a JSON object")
    return args


def build_config(args: argparse.Namespace) -> BenchConfig:
    return sized(
        args,
        FULL,
        QUICK,
        TINY,
        repeats=args.repeats,
        batches=tuple(args.batches) if args.batches else None,
        prompt_len=args.prompt_len,
        max_new_tokens=args.new_tokens,
        spread=args.spread,
    )


def engine_config_for(cfg: BenchConfig, dtype: str | None = None) -> EngineConfig:
    """Engine knobs: the defaults, with enough KV blocks and sequence slots that nothing is preempted."""
    block = EngineConfig().block_size
    max_batch = max(cfg.batches)
    # Every context of the biggest batch alive at its longest (contexts are freed between runs).
    throughput = max_batch * (blocks(cfg.prompt_len + cfg.max_new_tokens, block) + 1)
    memory = cfg.kv_requests * blocks(cfg.kv_prefix + cfg.kv_suffix + cfg.kv_new_tokens, block) + 64
    return EngineConfig(
        num_kv_blocks=max(throughput, memory),
        max_num_seqs=max(max_batch, cfg.kv_requests),
        max_num_batched_tokens=cfg.max_num_batched_tokens,
        device="cpu",
        dtype=dtype,
    )


@dataclass
class Run:
    """Everything one run measured, and what it ran."""

    results: list[BatchResult]
    kv: KVResult
    ceiling: Ceiling
    dtypes: dict[str, str]  # system -> dtype it computed in
    vllm: dict[str, Any] | None  # the vLLM worker's own description (version, settings), if it ran


def print_report(cfg: BenchConfig, model: str, params: int, machine: dict[str, Any], run: Run) -> None:
    """The markdown tables on stdout."""
    results, kv, c = run.results, run.kv, run.ceiling
    print(
        f"## engine_throughput — {model} ({params / 1e6:.1f}M params), "
        f"{machine['cpu_model']}, {machine['usable_cores']} cores, torch {machine['torch']} "
        f"({machine['torch_threads']} threads), load average {machine['load_average_1m']} at start\n"
    )
    systems = f"ours {run.dtypes['ours']}, HF generate {run.dtypes['hf']}"
    if run.vllm is not None:
        v = run.vllm
        mode = "eager" if v.get("enforce_eager") else "compiled"
        bind = v.get("env", {}).get("VLLM_CPU_OMP_THREADS_BIND")
        systems += (
            f", vLLM {v.get('vllm')} {run.dtypes['vllm']} ({mode}, max_num_batched_tokens "
            f"{v.get('max_num_batched_tokens')}, OMP threads bound to {bind})"
        )
    print(f"dtypes: {systems}.\n")
    print(
        f"prompts {round(cfg.spread * cfg.prompt_len)}..{cfg.prompt_len} tokens, {cfg.max_new_tokens} new "
        f"tokens, greedy; median of {'/'.join(str(r.repeats) for r in results)} repeats after a warm-up, "
        "± half the range. "
        "prefill = prompt tokens / T(1); decode = B(N-1) / (T(N) - T(1)); end-to-end = BN / T(N).\n"
    )
    print(throughput_table(results) + "\n")
    print(workload_table(results) + "\n")
    print(
        f"Batch-1 decode ceiling: memory read bandwidth {c.read_bytes_per_s / 1e9:.1f} GB/s (matrix-vector "
        f"product / sum over {c.bandwidth['tensor_bytes'] / (1 << 20):.0f} MiB, median of "
        f"{c.bandwidth['repeats']}, {c.bandwidth['threads']} threads) / {c.weight_bytes / 1e6:.0f} MB of "
        "weights read per step "
        f"({c.dtype}) = {fmt_num(c.ceiling_tps, 1)} tok/s; ours at batch 1: "
        f"{fmt_num(c.ours_b1_decode_tps, 1)} tok/s = {c.share:.0%} of it.\n"
    )
    print(
        f"KV memory: {kv.requests} requests sharing a {kv.prefix_tokens}-token prefix, "
        f"{kv.suffix_tokens}-token distinct suffix each, {kv.new_tokens} new tokens, "
        f"block size {kv.block_size}; blocks counted with every context alive.\n"
    )
    print(kv_table(kv) + "\n")


def json_payload(
    cfg: BenchConfig,
    model: str,
    hf_model: Any,
    engine_config: EngineConfig,
    model_config: Any,
    machine: dict[str, Any],
    run: Run,
    total_s: float,
) -> dict[str, Any]:
    """Every figure, the raw times, and what is needed to reproduce or judge them."""
    return {
        "benchmark": NAME,
        "config": asdict(cfg),
        "model": {
            "name": model,
            "config": asdict(model_config),
            "parameters": sum(p.numel() for p in hf_model.parameters()),
            "dtype": run.dtypes["ours"],
            "hf_attn_implementation": getattr(hf_model.config, "_attn_implementation", None),
        },
        "dtypes": run.dtypes,
        "engine_config": asdict(engine_config),
        "vllm": run.vllm,
        "machine": machine,
        "load_average_1m_at_end": load_average(),
        "definitions": {
            "prefill_tps": "prompt tokens (unpadded) / T(1)",
            "decode_tps": "B*(N-1) / (T(N) - T(1))",
            "e2e_tps": "B*N / T(N)",
            "T(1), T(N)": "median wall time of a batch with 1 / N new tokens (ours: fill + generate each)",
            "value": "the rate computed from the median T(1) and T(N)",
            "lo, hi": "min/max of the rates computed from each repeat's own T(1) and T(N)",
            "decode_ceiling": "memory read bytes/s / weight bytes read per batch-1 decode step",
        },
        "throughput": [asdict(r) for r in run.results],
        "decode_ceiling": asdict(run.ceiling),
        "kv_memory": {**asdict(run.kv), "ratio": run.kv.ratio},
        "total_s": total_s,
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    cfg = build_config(args)
    set_threads(args)
    import transformers

    # Quiet: the weight-loading progress bar and the over-long-sequence warning of the workload tokenizer.
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()

    started = time.perf_counter()
    machine = machine_info()
    engine_config = engine_config_for(cfg, args.dtype)
    with tempfile.TemporaryDirectory(prefix="engine-throughput-") as tmp:
        log(f"loading {args.model} into our engine and into transformers ...")
        engine, hf_model, folder = load_models(args.model, engine_config, Path(tmp))
        with engine:
            vllm = start_vllm(args, cfg, engine, folder, Path(tmp)) if args.vllm_python else None
            try:
                run = run_all(cfg, engine, hf_model, vllm)
            finally:
                if vllm is not None:
                    vllm.close()
    total_s = time.perf_counter() - started

    params = sum(p.numel() for p in hf_model.parameters())
    print_report(cfg, args.model, params, machine, run)
    print(f"total {total_s:.0f}s")
    if args.json:
        payload = json_payload(
            cfg, args.model, hf_model, engine_config, engine.model_config, machine, run, total_s
        )
        write_json(args.json, payload)
    print(result_line(NAME, result_metrics(run.results, run.kv, run.ceiling, total_s)))


def start_vllm(
    args: argparse.Namespace, cfg: BenchConfig, engine: LLMEngine, folder: Path, workdir: Path
) -> VLLMWorker:
    """The vLLM worker on ``folder`` (our weights), sized for the largest batch of this run."""
    max_model_len = min(engine.max_model_len, cfg.prompt_len + cfg.max_new_tokens + 16)
    max_num_seqs = max(cfg.batches)
    if args.vllm_dtype is None:
        args.vllm_dtype = "bfloat16" if cpu_has_native_bf16() else "float32"
    log(f"starting vLLM ({args.vllm_python}, {args.vllm_dtype}) on {folder} ...")
    worker = VLLMWorker(
        args.vllm_python,
        folder,
        dtype=args.vllm_dtype,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        engine_args=args.vllm_engine_args,
        env=vllm_env(engine.model_config, args.vllm_dtype, max_model_len, max_num_seqs, args.vllm_env),
        cwd=workdir,
    )
    info = worker.info
    log(f"vLLM {info.get('vllm')} ready in {info.get('load_s', math.nan):.0f}s, dtype {info.get('dtype')}")
    return worker


def run_all(cfg: BenchConfig, engine: LLMEngine, hf_model: Any, vllm: VLLMWorker | None = None) -> Run:
    """The memory bandwidth, the throughput rows for every batch size, then the KV memory comparison."""
    tokenizer = engine.tokenizer
    limit = engine.max_model_len
    if cfg.prompt_len + cfg.max_new_tokens > limit:
        raise SystemExit(f"prompt_len + new tokens exceed the model's context window ({limit})")
    need = max(cfg.kv_prefix + cfg.kv_requests * cfg.kv_suffix, cfg.prompt_len) * 4
    tokens = tokenize_text(tokenizer, need)
    log(f"memory bandwidth ({cfg.bandwidth_mib} MiB, {cfg.bandwidth_repeats} repeats) ...")
    bandwidth = memory_bandwidth(cfg.bandwidth_mib, cfg.bandwidth_repeats)
    model = engine_model(engine)
    ours_dtype = dtype_name(engine.config.torch_dtype())
    dtypes = {"ours": ours_dtype, "hf": dtype_name(hf_model.dtype)}
    if vllm is not None:
        dtypes["vllm"] = str(vllm.info.get("dtype"))
    ours = OurEngine(engine)
    hf = HFGenerate(hf_model, pad_token_id(tokenizer, hf_model))
    try:
        results = []
        for batch in cfg.batches:
            prompts = make_prompts(tokens, batch, cfg.prompt_len, cfg.spread, cfg.seed)
            log(f"batch {batch}: {sum(map(len, prompts))} prompt tokens, {cfg.max_new_tokens} new each")
            results.append(measure_batch(ours, hf, prompts, cfg.max_new_tokens, cfg, vllm))
        prefix_len = min(cfg.kv_prefix, limit - cfg.kv_suffix - cfg.kv_new_tokens - 1)
        prefix = tokens[:prefix_len]
        # Distinct suffixes from elsewhere in the text, so no two requests share more than the prefix.
        suffixes = [
            tokens[prefix_len + i * cfg.kv_suffix : prefix_len + (i + 1) * cfg.kv_suffix]
            for i in range(cfg.kv_requests)
        ]
        log(f"KV memory: {cfg.kv_requests} requests sharing a {prefix_len}-token prefix")
        ids = ours.context_ids(2 * cfg.kv_requests + 1)
        kv = ours.call(measure_kv(engine, ids, prefix, suffixes, cfg.kv_new_tokens))
    finally:
        ours.close()
    ceiling = decode_ceiling(bandwidth, decode_weight_bytes(model), ours_dtype, results)
    return Run(results, kv, ceiling, dtypes, vllm.info if vllm is not None else None)


if __name__ == "__main__":
    main()
