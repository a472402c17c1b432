"""vLLM as a system of an engine-level comparison: ``LLM.generate`` in a worker process of vLLM's own
interpreter (`VLLMWorker`; the other side is ``benchmarks/vllm_worker.py``), started on our weights by
`start_vllm` from the flags of `benchmarks.harness.vllm_settings.add_vllm_flags`.

The worker leads a process group of its own (`benchmarks.harness.process_groups`): vLLM's engine
processes join it, and the whole group is stopped when the worker is closed, when this process exits, or
when it gets SIGTERM or SIGINT.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import queue
import subprocess
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.harness.generators import Outputs
from benchmarks.harness.output import log
from benchmarks.harness.process_groups import start_group, stop_group
from benchmarks.harness.vllm_settings import vllm_env
from server.engine import LLMEngine
from server.engine.config import cpu_has_native_bf16

__all__ = ["WORKER_SCRIPT", "VLLMWorker", "start_vllm", "vllm_dtype"]

WORKER_SCRIPT = Path(__file__).resolve().parents[1] / "vllm_worker.py"


class VLLMWorker:
    """vLLM's ``LLM.generate`` in a worker process (`benchmarks/vllm_worker.py`) of another interpreter.

    The worker loads the model once, then times each batch itself (JSON lines over its stdin / stdout), so
    the pipe is not in the figures. Its log goes to our stderr. It leads its own process group
    (`start_group`), so vLLM's engine processes go with it whatever ends the run.
    """

    name = "vllm"
    # After its last message vLLM's shared-memory readers (engine core and worker) poll with `sched_yield` for
    # 1 s (`SpinCondition.busy_loop_s`) before they sleep: on 2 cores a system timed in that second ran at
    # about half speed (our fill of 64 prompts: 1.58 s right after a vLLM run, 0.89 s two seconds later).
    # `batch_timing.time_batch` waits this long after a vLLM run before it times the next system.
    settle_s = 1.2

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


def vllm_dtype(args: argparse.Namespace) -> str:
    """vLLM's dtype for the flags of `vllm_settings.add_vllm_flags`: ``--vllm-dtype``, else bf16 where the
    CPU computes it natively, else fp32 (what our engine defaults to on the same CPU)."""
    return str(args.vllm_dtype or ("bfloat16" if cpu_has_native_bf16() else "float32"))


def start_vllm(
    args: argparse.Namespace,
    folder: Path,
    engine: LLMEngine,
    max_model_len: int,
    max_num_seqs: int,
    workdir: Path,
) -> VLLMWorker | None:
    """The vLLM worker of the flags of `vllm_settings.add_vllm_flags` on ``folder`` (our weights), sized for
    ``max_num_seqs`` requests of ``max_model_len`` tokens, run in ``workdir``; None without
    ``--vllm-python``."""
    if not args.vllm_python:
        return None
    dtype = vllm_dtype(args)
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
