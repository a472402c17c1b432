"""`EngineCore`: an engine's state and what changes it — contexts, blocks, the waiting and running requests,
the commands that change them (`handle`) and the step that runs the model over them (`step`).

One thread drives a core: `server.engine.engine.LLMEngine`'s engine thread (the async front posts commands
to it), or the simulator's event loop (`server.sim.SimEngine`, the same bookkeeping over a latency model).
A core takes no lock and does no I/O; a command is validated here, so bad input fails only its own request,
with a typed error.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Literal, Protocol

import torch

from server.engine.block_manager import BlockAllocator
from server.engine.config import EngineConfig, ModelConfig
from server.engine.context import Context, ContextTable
from server.engine.engine_front import Abort, Call, Compiled, Free, Sink, Submit
from server.engine.errors import (
    ContextBusyError,
    ContextExistsError,
    EngineError,
    InvalidRequestError,
    RequestAbortedError,
    UnknownContextError,
)
from server.engine.guided import CompiledGrammar, GrammarCompiler, Guide
from server.engine.postprocess import finish_reason, next_tokens, prompt_logprobs
from server.engine.remote_kv import KVLease, KVSourceLostError, RemoteRows
from server.engine.request import Request
from server.engine.sampling import make_generator
from server.engine.scheduler import ScheduledChunk, Scheduler
from server.engine.step_features import StepFeatures, StepRecord, step_features
from server.engine.step_timing import StepTiming
from server.engine.submit_checks import check_length, check_submit, inherited
from server.engine.wire import EngineStats

log = logging.getLogger(__name__)


class StepRunner(Protocol):
    """Runs a scheduled step: `ModelRunner` (the model over the paged KV cache) or the simulator's."""

    grouped_decode_steps: int
    shared_prefix_decode: Literal["auto", "always", "never"]  # `EngineConfig`'s, switchable between steps
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

    def wait_for_device(self) -> None:
        """Return once the device has run everything queued (a traced step's time is the step's)."""
        ...


@dataclass(frozen=True)
class ForwardPass:
    """One step's forward pass: the final hidden states (a row per chunk's last token, `StepRunner.run`),
    when it started and, for a traced step, the batch's features."""

    hidden: torch.Tensor
    started: float
    features: StepFeatures | None


class EngineCore:
    """An engine's state and its single-threaded logic (see the module docstring)."""

    def __init__(
        self,
        runner: StepRunner,
        tokenizer: Any,
        model_config: ModelConfig,
        config: EngineConfig,
        model_name: str,
        num_blocks: int,
        copy_block: Callable[[int, int], None],
        post: Callable[[object], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """The state over ``runner``'s KV cache of ``num_blocks`` blocks (``copy_block`` copies one on
        write). ``post`` hands a command back to whoever drives this core, from another thread (a guided
        generate's compiled grammar). ``clock`` (seconds) times the waiting queue's aging under
        ``scheduling="sjf"``."""
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
        self.allocator = BlockAllocator(num_blocks)
        self.contexts = ContextTable(self.allocator, config.block_size, copy_block)
        self.scheduler = Scheduler(
            self.contexts,
            config.max_num_batched_tokens,
            config.max_num_seqs,
            max_running_tokens=config.max_running_tokens,
            scheduling=config.scheduling,
            sjf_aging_s=config.sjf_aging_s,
            clock=clock,
        )
        self.runner = runner
        self.requests: dict[Sink, Request] = {}
        self.deferred: list[Submit] = []  # forks waiting for a busy parent to finish
        self.compiling: set[Sink] = set()  # guided generates whose grammar is being compiled
        self.grammars = GrammarCompiler(tokenizer, self.vocab_size, self.eos_token_ids)
        self._post = post
        self.stalled = False  # the last step found nothing it could schedule: wait for a command
        self.steps = 0
        self.tokens_in_last_step = 0
        self.prefill_tokens = 0
        self.decode_tokens = 0
        self.leases: dict[int, KVLease] = {}  # KV lent to other engines, by lease id (`kv_exchange`)
        self.kv_bytes_moved = 0  # KV exported and imported (`kv_exchange`)
        self.remote_attention_bytes = 0  # queries and partials exchanged with KV holders (`remote_kv`)
        self.timing = StepTiming()  # recent step times, for the manager's TTFT/TPOT predictions
        self.queued_prefill = 0  # prompt tokens not computed yet, of every request here (as of a step)
        # The last `trace_steps` steps' features and wall time, for fitting the simulator's latency model.
        self.step_trace: deque[StepRecord] | None = (
            deque(maxlen=config.trace_steps) if config.trace_steps else None
        )

    def stats(self) -> EngineStats:
        alloc = self.allocator
        return EngineStats(
            model=self.model_name,
            block_size=self.block_size,
            blocks_total=alloc.num_blocks,
            blocks_used=alloc.num_used,
            blocks_free=alloc.num_free,
            blocks_peak=alloc.peak_used,
            contexts=len(self.contexts),
            running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting) + len(self.deferred),
            tokens_in_last_step=self.tokens_in_last_step,
            prefill_tokens_computed=self.prefill_tokens,
            decode_tokens_computed=self.decode_tokens,
            steps=self.steps,
            preemptions=self.scheduler.num_preemptions,
            evictions=self.scheduler.num_evictions,
            grouped_decode_steps=self.runner.grouped_decode_steps,
            max_model_len=self.max_model_len,
            max_num_seqs=self.config.max_num_seqs,
            role=self.config.role,
            kv_leases=len(self.leases),
            decode_step_s=self.timing.decode_step_s,
            prefill_s_per_token=self.timing.prefill_s_per_token,
            queued_prefill_tokens=self.queued_prefill,
            kv_bytes_moved=self.kv_bytes_moved,
            remote_attention_bytes=self.remote_attention_bytes,
        )

    def handle(self, cmd: object) -> None:
        if isinstance(cmd, Submit):
            try:
                if cmd.sampling is not None and cmd.sampling.guided is not None and cmd.grammar is None:
                    self._compile(cmd)
                else:
                    self._submit(cmd)
            except EngineError as e:
                cmd.sink.finish(None, e)
        elif isinstance(cmd, Compiled):
            if cmd.submit.sink in self.compiling:  # else it was aborted meanwhile
                self.compiling.discard(cmd.submit.sink)
                if cmd.error is None:
                    self.handle(cmd.submit)
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
            req = self.requests.get(cmd.sink)
            if req is not None:
                self._finish(req, error=RequestAbortedError("the request was cancelled"))
            elif cmd.sink in self.compiling:
                self.compiling.discard(cmd.sink)
                cmd.sink.finish(None, RequestAbortedError("the request was cancelled"))
            else:
                self.deferred = [d for d in self.deferred if d.sink is not cmd.sink]

    def _compile(self, cmd: Submit) -> None:
        """Send a guided generate's constraint to the compiler thread; it comes back as `Compiled`."""
        assert cmd.sampling is not None and cmd.sampling.guided is not None
        cmd.sampling.validate(self.vocab_size)
        self.compiling.add(cmd.sink)

        def done(grammar: CompiledGrammar | None, error: BaseException | None) -> None:
            if error is not None and not isinstance(error, EngineError):
                error = EngineError(f"guided decoding failed to compile: {error!r}")
            self._post(Compiled(replace(cmd, grammar=grammar), error))

        self.grammars.submit(cmd.sampling.guided, done)

    def _submit(self, cmd: Submit) -> None:
        kind = "fill" if cmd.sampling is None else "generate"
        parent_tokens = None
        if cmd.parent_id is not None and cmd.parent_id in self.contexts:
            parent_tokens = len(self.contexts.get(cmd.parent_id).token_ids)
        check_submit(cmd, kind, self.vocab_size, parent_tokens)
        if cmd.context_id in self.contexts:
            ctx = self.contexts.get(cmd.context_id)
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
            self.check_length(
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
                if cmd.parent_id not in self.contexts:
                    raise UnknownContextError(
                        f"{kind}: parent context {cmd.parent_id} does not exist (never created, or freed)"
                    )
                parent = self.contexts.get(cmd.parent_id)
                if cmd.remote is not None or parent.remote is not None:
                    raise InvalidRequestError(
                        f"{kind}: a context with a remote prefix is neither forked nor forked from; "
                        "start it without a parent (the remote prefix is its beginning)"
                    )
                if parent.busy:  # fork once the parent's own request is done: its state is in flux
                    self.deferred.append(cmd)
                    return
            inherited_tokens = 0 if parent is None else inherited(kind, parent, cmd.parent_len)
            offset = 0 if cmd.remote is None else cmd.remote.num_tokens
            self.check_length(kind, inherited_tokens + len(cmd.token_ids), cmd.sampling is not None, offset)
            ctx = self.contexts.create(cmd.context_id, parent, cmd.parent_len)
            ctx.remote = cmd.remote
        self._start(ctx, cmd)

    def check_length(self, kind: str, total: int, generate: bool, remote: int = 0) -> None:
        """``total`` tokens held here, after ``remote`` tokens held by another engine (`check_length`)."""
        limits = (self.max_model_len, self.block_size, self.allocator.num_blocks)
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
            self.contexts.uncache_last(ctx)
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
        self.requests[cmd.sink] = req
        self.scheduler.add(req)
        self.queued_prefill += ctx.num_pending

    def admit_deferred(self) -> None:
        if not self.deferred:
            return
        ready = [d for d in self.deferred if not self._parent_busy(d)]
        if not ready:
            return
        self.deferred = [d for d in self.deferred if self._parent_busy(d)]
        for cmd in ready:
            self.handle(cmd)

    def _parent_busy(self, cmd: Submit) -> bool:
        parent = cmd.parent_id
        return parent is not None and parent in self.contexts and self.contexts.get(parent).busy

    def _free(self, context_id: int) -> None:
        ctx = self.contexts.get(context_id)
        if ctx.busy:
            for req in list(self.requests.values()):
                if req.context is ctx:
                    self._finish(req, error=RequestAbortedError(f"context {context_id} was freed"))
        self.contexts.free(context_id)

    def step(self) -> None:
        """One step: schedule a batch, run the model over it, then advance, sample and finish its requests."""
        batch = self.scheduler.schedule()
        if not batch:
            self.stalled = not self._finish_stuck()
            return
        forward = self._forward(batch)
        if forward is not None:
            self._postprocess(batch, forward)
        self.queued_prefill = self.scheduler.pending_prefill_tokens()

    def _forward(self, batch: list[ScheduledChunk]) -> ForwardPass | None:
        """The model over ``batch`` (None when it failed: that fails this step's requests, not the engine)."""
        self.steps += 1
        features = step_features(batch, self.block_size) if self.step_trace is not None else None
        started = time.perf_counter()
        try:
            hidden = self.runner.run(batch)
        except Exception as e:
            log.exception("engine step failed")
            for c in batch:
                self._finish(c.request, error=EngineError(f"the engine step failed: {e!r}"))
            return None
        self.tokens_in_last_step = sum(c.num_tokens for c in batch)
        decodes = sum(1 for c in batch if c.request.decoding)
        prefills = sum(c.num_tokens for c in batch if not c.request.decoding)
        self.timing.observe(time.perf_counter() - started, prefills, decodes)
        return ForwardPass(hidden, started, features)

    def _postprocess(self, batch: list[ScheduledChunk], forward: ForwardPass) -> None:
        """Advance every chunk's context by the tokens it computed, sample the generates that reached their
        end, finish the fills that did, and trace the step."""
        hidden = forward.hidden
        lost = self._remote_exchange_done()
        to_sample = [i for i, c in enumerate(batch) if self._advance(i, c, hidden, lost)]
        if to_sample:
            try:
                self._sample(batch, hidden, to_sample)
            except Exception as e:  # a sampler failure fails the requests it was sampling, not the engine
                log.exception("sampling failed")
                for i in to_sample:
                    self._finish(batch[i].request, error=EngineError(f"sampling failed: {e!r}"))
        if forward.features is not None and self.step_trace is not None:
            # A fill reads nothing back: on a GPU its time would be the host's queueing, not the step's.
            self.runner.wait_for_device()
            self.step_trace.append(StepRecord(forward.features, time.perf_counter() - forward.started))

    def _advance(
        self, i: int, chunk: ScheduledChunk, hidden: torch.Tensor, lost: dict[int, BaseException]
    ) -> bool:
        """Chunk ``i`` of the step computed its tokens: count them into its context; a fill that reached its
        end keeps its last hidden state and finishes. True for a generate that is to sample now."""
        req, ctx = chunk.request, chunk.request.context
        if ctx.context_id in lost and ctx.remote is not None:
            self._finish(req, error=KVSourceLostError(f"context {ctx.context_id}: {lost[ctx.context_id]}"))
            return False
        if req.prompt_logprobs is not None:
            rows = self.runner.scored_rows.get(i, hidden[i : i + 1] if chunk.num_tokens == 1 else None)
            if not self._score_chunk(chunk, rows):
                return False
        if req.decoding:
            self.decode_tokens += chunk.num_tokens
        else:
            self.prefill_tokens += chunk.num_tokens
        ctx.num_cached += chunk.num_tokens
        ctx.last_used = self.steps
        if ctx.num_pending != 0:
            return False
        if req.is_generate:
            return True
        ctx.last_hidden = hidden[i].clone()
        scored = req.prompt_logprobs
        self._finish(req, result=len(ctx.token_ids) if scored is None else list(scored))
        return False

    def _score_chunk(self, chunk: ScheduledChunk, rows: torch.Tensor | None) -> bool:
        """Score the tokens a scoring fill's chunk predicts from its ``rows`` (each token's final hidden
        state scores the next token); False when that failed, which fails the fill."""
        req, ctx = chunk.request, chunk.request.context
        assert req.prompt_logprobs is not None
        try:
            if rows is None:
                raise RuntimeError("the step runner returned no rows for a scoring fill")
            scored = prompt_logprobs(self.runner.logits, rows, ctx.token_ids, ctx.num_cached, req.prompt_top)
        except Exception as e:  # this fill fails, not the step's other requests
            log.exception("scoring failed")
            self._finish(req, error=EngineError(f"scoring the prompt failed: {e!r}"))
            return False
        del req.prompt_logprobs[ctx.num_cached :]  # a preempted fill recomputes its chunks
        req.prompt_logprobs.extend(scored)
        return True

    def _remote_exchange_done(self) -> dict[int, BaseException]:
        """Count the step's exchanges with remote KV holders; the contexts whose holder failed, by id."""
        rows = self.runner.remote_rows
        if rows is None:
            return {}
        self.remote_attention_bytes += rows.bytes_moved
        return rows.lost()

    def _sample(self, batch: list[ScheduledChunk], hidden: torch.Tensor, rows: list[int]) -> None:
        reqs = [batch[i].request for i in rows]
        tokens = next_tokens(self.runner.logits(hidden[rows]).float(), reqs)
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
        for req in self.scheduler.running:
            if req.decoding and req.sampling is not None:
                self._finish(req, result=req.result(self._detokenize(req.output_ids), "length"))
                return True
        return False

    def _finish(self, req: Request, result: object = None, error: BaseException | None = None) -> None:
        if req.finished:
            return
        req.finished = True
        self.scheduler.remove(req)
        req.context.busy = False
        self.requests.pop(req.handle, None)  # type: ignore[call-overload]  # the handle is its Sink
        req.on_finish(result, error)

    def fail_all(self, error: EngineError) -> None:
        """Answer every request here with ``error`` (the engine stopped)."""
        for req in list(self.requests.values()):
            self._finish(req, error=error)
        for cmd in self.deferred:
            cmd.sink.finish(None, error)
        self.deferred = []
        for sink in self.compiling:
            sink.finish(None, error)
        self.compiling.clear()
