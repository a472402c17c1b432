"""The step executor: runs a session's steps on the engines as they become runnable.

A step runs once it is ready (its inputs have values) and activated (a `get` reaches it, or its call came with
`criteria`). The executor renders the step's prompt, tokenizes it whole with the engine's tokenizer (so the
output equals `/v1/completions` on the same text), waits for the placement to give it an engine, forks from
the longest kept context whose tokens prefix it (`KeptContexts`), fills the rest, generates, applies the
output's transforms, sets the variable and dispatches whatever that made runnable. Any failure fails the
variable and everything downstream of it.

A step whose engine fails (`engine_unavailable`) runs again from its inputs on an engine in service (nothing
of its output was delivered), up to `ManagerConfig.max_step_retries` times.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from parrot.protocol import SamplingConfig

from server.engine import EngineError, SamplingParams
from server.engine.errors import EngineFailedError, engine_unavailable
from server.engine.special_text import SpecialText
from server.serve.deduction import StepObjective, objective
from server.serve.engine_registry import EngineRegistry
from server.serve.errors import ModelNotFoundError, NoEngineError
from server.serve.graph import SessionGraph, StepNode
from server.serve.ir import (
    TextFill,
    input_vars,
    prefix_hashes,
    prompt_chars,
    render_prompt,
    text_before,
)
from server.serve.kept_contexts import KeptContexts, namespace
from server.serve.loop_slices import LoopSlices
from server.serve.manager_config import ManagerConfig
from server.serve.output_lengths import LengthEstimate, OutputLengths, template_key
from server.serve.placement import (
    NoServingEngineError,
    PinnedEngineGoneError,
    Placement,
    RequestTooLargeError,
)
from server.serve.scheduler import QueuedRequest
from server.serve.sessions import Session
from server.serve.step_records import StepRecord, StepRecords, task_group_key
from server.serve.transform_runner import run_transforms
from server.serve.transforms import TransformError, ValueKind, apply_transforms, render_value
from server.serve.variable_waits import VariableWaits

log = logging.getLogger(__name__)

STEP_STARTS_PER_SLICE = 32  # steps that tokenize and queue in one event-loop iteration (`LoopSlices`)
# Prompts longer than this are tokenized on a worker thread (the tokenizer releases the GIL): a 1 MB prompt
# takes ~1.5 s to encode, which on the event loop would stall every session and /health.
ENCODE_OFF_LOOP_CHARS = 32 * 1024


def prompt_too_long(chars: int, limit: int) -> str:
    """Why a prompt of ``chars`` characters is refused."""
    return (
        f"the prompt renders to {chars} characters (or more), over the server's limit of {limit} "
        "(ManagerConfig.max_prompt_chars): shorten the values, or repeat a long input fewer times in the "
        "template"
    )


class _AttemptFailed(Exception):
    """A step's attempt failed because its engine did (``cause``); the step may run again elsewhere."""

    def __init__(self, engine_index: int, cause: EngineError) -> None:
        super().__init__(str(cause))
        self.engine_index = engine_index
        self.cause = cause


@dataclass
class _Prepared:
    """A dispatched step's prompt, rendered at dispatch: its text, its cache namespace ("" shared by all
    sessions, else a salt's), the namespaced prefix hash at each segment boundary (counted in flight while
    the step runs) and, for a later step of a call, what the earlier steps left."""

    prompt: str
    namespace: str
    boundaries: list[tuple[int, str]]
    progress: _CallProgress | None
    specials: SpecialText  # the model's special-token strings, masked in the values (`SpecialText.mask`)
    refusal: str | None = None  # why the step fails instead of running (its prompt was not rendered)


@dataclass
class _CallProgress:
    """What a multi-step call's next step needs from the steps before it."""

    engine: int
    raw_outputs: dict[str, str]  # var_id -> generated text of every step of the call so far


class StepExecutor:
    """Dispatches and runs the steps of every session (one asyncio task per step)."""

    def __init__(
        self,
        registry: EngineRegistry,
        kept: KeptContexts,
        placement: Placement,
        waits: VariableWaits,
        config: ManagerConfig,
        lengths: OutputLengths | None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.registry = registry
        self.kept = kept
        self.placement = placement
        self.waits = waits
        self.config = config
        self.lengths = lengths
        self._clock = clock
        # What happened to each step (`step_records`), and the records of the steps running now.
        self.steps = StepRecords()
        self._records: dict[tuple[str, int], StepRecord] = {}
        # Prefix hash -> dispatched steps (not finished) whose prompt has a segment boundary there.
        self._inflight: Counter[str] = Counter()
        self._calls: dict[tuple[str, str], _CallProgress] = {}  # (session, call) of multi-step calls
        self._step_starts = LoopSlices(STEP_STARTS_PER_SLICE)
        self._dispatch_pending: set[str] = set()
        self._tasks: dict[str, set[asyncio.Task[None]]] = {}  # session -> its running steps

    def open_session(self, session_id: str) -> None:
        """Steps of ``session_id`` may run from now on."""
        self._tasks[session_id] = set()

    def has_session(self, session_id: str) -> bool:
        """Whether ``session_id`` is open here (not deleted)."""
        return session_id in self._tasks

    async def close_session(self, session: Session) -> None:
        """Cancel the session's running steps and forget what its calls left (it was deleted)."""
        tasks = self._tasks.pop(session.session_id, set())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for key in [k for k in self._calls if k[0] == session.session_id]:
            del self._calls[key]
        self.steps.drop_session(session.session_id)

    def running(self) -> int:
        """How many steps run (or wait for an engine) now."""
        return sum(len(tasks) for tasks in self._tasks.values())

    def dispatch(self, session: Session) -> None:
        """Dispatch what became runnable, once the operations of this loop iteration are all applied.

        Deferred (and coalesced per session) so that a batch's calls and its get — or calls submitted one
        after another without awaiting — are all in the graph before anything is dispatched: deduction sees
        the get first, and parallel steps see each other's prefix boundaries."""
        if session.session_id in self._dispatch_pending:
            return
        self._dispatch_pending.add(session.session_id)
        asyncio.get_running_loop().call_soon(self._dispatch_now, session)

    def _dispatch_now(self, session: Session) -> None:
        self._dispatch_pending.discard(session.session_id)
        if session.session_id not in self._tasks:  # deleted meanwhile
            return
        graph = session.graph
        self._reprioritise(session)
        eager = self.config.dispatch == "eager"
        steps = graph.ready_steps() if eager else graph.runnable_steps()
        # Render every step first and count its prefix boundaries as in flight, so that steps dispatched
        # together (six reviewers of one document) find their common prefix before any of them is placed.
        prepared = []
        for node in steps:
            graph.mark_dispatched(node)
            prepared.append((node, self._prepare(session, node)))
        tasks = self._tasks.setdefault(session.session_id, set())
        for node, prep in prepared:
            task = asyncio.get_running_loop().create_task(self._run_step(session, node, prep))
            tasks.add(task)
            task.add_done_callback(tasks.discard)

    def _reprioritise(self, session: Session) -> None:
        """A get that reached steps already waiting for an engine changes their objective there."""
        for node in session.graph.take_reprioritised():
            if node.status != "dispatched":
                continue  # not queued yet: it is dispatched with its new objective
            goal = objective(node)
            self.placement.reprioritise(
                request_key(session, node),
                criteria=goal.criteria,
                task_group=task_group_key(goal.task_group),
            )

    def _prepare(self, session: Session, node: StepNode) -> _Prepared:
        """Render a step's prompt and count its prefix boundaries as in flight (`_release_prepared`)."""
        call = node.call
        progress = self._calls.pop((session.session_id, call.call_id), None)
        specials = SpecialText(()) if call.parse_special_tokens else self.registry.special_text(call.model)
        values = self._values(session.graph, node, progress, specials)
        ns = namespace(call.cache_salt or session.cache_salt)
        chars = prompt_chars(call, node.id.index, values)
        limit = self.config.max_prompt_chars
        if chars > limit:
            return _Prepared("", ns, [], progress, specials, refusal=prompt_too_long(chars, limit))
        prompt = render_prompt(call, node.id.index, values)
        boundaries: list[tuple[int, str]] = []
        if self.config.prefix_sharing:
            boundaries = [(off, ns + h) for off, h in prefix_hashes(call, node.id.index, values)]
            self._inflight.update(h for _, h in boundaries)
        return _Prepared(prompt, ns, boundaries, progress, specials)

    def _release_prepared(self, prep: _Prepared) -> None:
        for _, digest in prep.boundaries:
            self._inflight[digest] -= 1
            if self._inflight[digest] <= 0:
                del self._inflight[digest]
        prep.boundaries = []

    async def _run_step(self, session: Session, node: StepNode, prep: _Prepared) -> None:
        graph = session.graph
        goal = objective(node)
        record = self.steps.add(
            StepRecord(
                session.session_id,
                node.call.call_id,
                node.step.index,
                node.output,
                node.call.func_name,
                goal.criteria,
                task_group_key(goal.task_group),
                self._clock(),
            )
        )
        key = (node.call.call_id, node.step.index)
        self._records[key] = record
        try:
            value, kind = await self._execute(session, node, prep)
        except asyncio.CancelledError:
            self.steps.ended(record, self._clock(), "cancelled")
            raise
        except TransformError as e:  # the refused text travels as data: the message quotes only its start
            self.steps.ended(record, self._clock(), str(e))
            self._fail(session, node, str(e), e.error_type, e.text)
            return
        except (
            EngineError,
            RequestTooLargeError,
            NoEngineError,
            NoServingEngineError,
            ModelNotFoundError,
        ) as e:
            self.steps.ended(record, self._clock(), str(e))
            self._fail(session, node, str(e), e.error_type)
            return
        except Exception as e:  # a bug must not leave the variable pending forever
            log.exception("step %s failed", node.id)
            self.steps.ended(record, self._clock(), f"internal error: {e!r}")
            self._fail(session, node, f"internal error: {e!r}", "internal_error")
            return
        finally:
            self._release_prepared(prep)
            self._records.pop(key, None)
        if session.session_id not in self._tasks:  # deleted while the step ran
            return
        self.steps.ended(record, self._clock())
        graph.complete_step(node, value, kind)
        self.waits.settled(session, node.output)
        self.dispatch(session)

    async def _execute(self, session: Session, node: StepNode, prep: _Prepared) -> tuple[str, ValueKind]:
        """Run one step on an engine; returns its output variable's value and kind (after transforms).

        A step whose engine fails (`engine_unavailable`) runs again from its inputs on an engine in service
        — nothing of its output was delivered — up to ``max_step_retries`` times; then it fails with
        `EngineFailedError` naming the engines. A later step of a call runs where the call's context is,
        unless that engine left service: its prompt (the earlier steps' raw outputs included) is then
        filled whole on another engine, which gives the same tokens the context held."""
        if prep.refusal is not None:
            raise RequestTooLargeError(prep.refusal)
        failures: list[str] = []
        pinned = prep.progress.engine if prep.progress is not None else None
        while True:
            if pinned is not None and not self.registry.in_service(pinned):
                pinned = None
            try:
                return await self._attempt(session, node, prep, pinned)
            except PinnedEngineGoneError:
                pinned = None  # it left while the step waited: nothing ran, not a failure of the step
            except _AttemptFailed as e:
                failures.append(f"{self.registry.engine_name(e.engine_index)}: {e.cause}")
                if len(failures) > self.config.max_step_retries:
                    raise EngineFailedError(
                        f"the step's engine failed {len(failures)} times (retry limit "
                        f"{self.config.max_step_retries}): " + "; ".join(failures)
                    ) from e.cause
                log.warning("%s runs again: %s", node.id, failures[-1])
                pinned = None

    async def _attempt(
        self, session: Session, node: StepNode, prep: _Prepared, pinned: int | None
    ) -> tuple[str, ValueKind]:
        """One placement and run of a step (on ``pinned`` if given). An engine failure takes the engine out
        of service and raises `_AttemptFailed`."""
        # A call's steps share one context chain, so one engine; engines of one model share a tokenizer.
        # A burst of ready steps starts over several loop iterations, tenants taking turns.
        await self._step_starts.turn(session.client)
        serving = [pinned] if pinned is not None else self.registry.serving(node.call.model)
        tokenizer = self.registry.engines[serving[0]].tokenizer
        token_ids = await _encode(tokenizer, prep.specials, prep.prompt)
        shared: list[int] = []
        shared_key: str | None = None
        if self.config.prefix_sharing and pinned is None:
            shared, shared_key = self._shared_prefix(tokenizer, node, prep, token_ids)
        estimate = self._estimate(node, prep, len(token_ids))
        request = self._queued(
            session, node, objective(node), token_ids, shared, shared_key, serving, prep, pinned is not None
        )
        if estimate is not None and self.config.admit_by_predicted_length is not None:
            request = self._admitted_by_prediction(request, node, estimate)
        engine_index = await self.placement.acquire(request)
        try:
            return await self._run_on(engine_index, session, node, prep, token_ids, shared, request, estimate)
        except EngineError as e:
            if not engine_unavailable(e):
                raise
            await self.registry.engine_failed(engine_index, e)
            raise _AttemptFailed(engine_index, e) from e
        finally:
            self.placement.release(engine_index, request)

    def _shared_prefix(
        self, tokenizer: Any, node: StepNode, prep: _Prepared, token_ids: list[int]
    ) -> tuple[list[int], str | None]:
        """The tokens of the longest prompt prefix this step should share, and its key, or ``([], None)``.

        Candidates are the step's segment boundaries (constant text and variable values alike) that
        another dispatched step also has — the shared part is prefilled once and every step forks it — and,
        for a call's first step, the end of its leading constant text (a system prompt later calls will
        share). The prefix's tokens are those of its text that truly prefix ``token_ids`` (whole-prompt
        tokenization may merge tokens across the boundary), short of the whole prompt."""
        candidates = [(off, h) for off, h in prep.boundaries if self._inflight[h] >= 2]
        first = node.step.fills[0] if node.id.index == 0 and node.step.fills else None
        if isinstance(first, TextFill) and first.name is None and prep.boundaries:
            candidates.append(prep.boundaries[0])
        for offset, digest in sorted(candidates, reverse=True):
            prefix = prep.specials.encode(tokenizer, prep.prompt[:offset])
            while prefix and (token_ids[: len(prefix)] != prefix or len(prefix) >= len(token_ids)):
                prefix.pop()
            if len(prefix) >= self.config.min_shared_prefix_tokens:
                return prefix, digest
        return [], None

    def _queued(
        self,
        session: Session,
        node: StepNode,
        goal: StepObjective,
        token_ids: list[int],
        shared: list[int],
        shared_key: str | None,
        serving: list[int],
        prep: _Prepared,
        pinned: bool,
    ) -> QueuedRequest:
        """The scheduler's view of a step: its tokens beyond its shared prefix, objective, group, shared
        prefix key and how much of its prompt each engine holds."""
        cached = {}
        for i in serving:
            match = self.kept.match(i, prep.namespace, token_ids)
            if match is not None:
                cached[i] = match.length
        affinity = self.config.prefix_affinity
        return QueuedRequest(
            key=request_key(session, node),
            app=session.session_id,
            tenant=session.client,
            seq=self.placement.next_seq(),
            tokens=len(token_ids) - len(shared) + node.step.gen.sampling.max_tokens,
            criteria=goal.criteria,
            task_group=task_group_key(goal.task_group),
            depth=goal.depth,
            shared_prefix=shared_key if affinity else None,
            cached=cached if affinity else {},
            pinned=serving[0] if pinned else None,
            model=None if pinned else node.call.model,
        )

    def _estimate(self, node: StepNode, prep: _Prepared, prompt_tokens: int) -> LengthEstimate | None:
        """The step's predicted output length and engine priority (None with prediction off)."""
        if self.lengths is None:
            return None
        step = node.step
        return self.lengths.estimate(
            template_key(node.call.func_name, step.index),
            prep.prompt,
            prompt_tokens,
            _sampling(step.gen.sampling),
            group=task_group_key(objective(node).task_group),
        )

    def _admitted_by_prediction(
        self, request: QueuedRequest, node: StepNode, estimate: LengthEstimate
    ) -> QueuedRequest:
        """``request`` counted with its predicted output (times the configured margin) instead of
        ``max_tokens`` (SSJF §6): more requests fit an engine's capacity; when one writes more than that,
        the engine's preemption makes room, as for any request that outgrows the KV cache."""
        margin = self.config.admit_by_predicted_length or 1.0
        max_tokens = node.step.gen.sampling.max_tokens
        reserved = min(max_tokens, math.ceil(estimate.predicted * margin))
        return dataclasses.replace(request, tokens=request.tokens - max_tokens + reserved)

    async def _run_on(
        self,
        engine_index: int,
        session: Session,
        node: StepNode,
        prep: _Prepared,
        token_ids: list[int],
        shared: list[int],
        request: QueuedRequest,
        estimate: LengthEstimate | None,
    ) -> tuple[str, ValueKind]:
        call, step = node.call, node.step
        key = (session.session_id, call.call_id)
        engine = self.registry.engines[engine_index]
        ns = prep.namespace
        await self.kept.share_prefix(engine_index, ns, shared)
        context_id = self.kept.new_id()
        sampling = _sampling(step.gen.sampling)
        priority = None if estimate is None else estimate.priority
        record = self._records.get((call.call_id, step.index))
        if record is not None:
            self.steps.started(record, engine_index, self.registry.engine_name(engine_index), self._clock())
            record.prompt_tokens = len(token_ids)
        try:
            saved = await self.kept.fill(engine_index, ns, context_id, token_ids, priority, session.client)
            if record is not None:
                record.prefill_tokens_saved = saved
            # A latency-bound step carries the engine's latency cap, so the engine keeps its batch under
            # it against traffic the placement does not see (the OpenAI endpoints).
            latency_cap = self.registry.caps(engine)[1] if request.latency_bound else None
            live = session.session_id in self._tasks  # a deleted session's step keeps no text for anyone
            text = self.waits.text(session.session_id, step.gen.var_id, live=live)
            text.start(engine.tokenizer, sampling.stop)
            stream = engine.submit_generate(
                context_id,
                sampling,
                stream=True,
                latency_cap=latency_cap,
                priority=priority,
                tenant=session.client,
            )
            async for token_id in stream:  # readers of the variable's text see each token as it comes
                text.push(token_id)
            result = await stream.result()
            text.finish(result.text)
        except BaseException:  # failed or cancelled (session deleted): the step's context goes too
            await self.registry.free(engine_index, context_id)
            raise
        if estimate is not None and self.lengths is not None:
            self.lengths.observe(estimate, len(result.token_ids))
        held = token_ids + result.token_ids
        last = step.index + 1 == len(call.steps)
        if not last:  # the next step continues this context with the raw output
            raw = {**(prep.progress.raw_outputs if prep.progress else {}), step.gen.var_id: result.text}
            self._calls[key] = _CallProgress(engine_index, raw)
        try:
            if step.gen.transforms:  # parsers may be slow on hostile text: off the event loop
                transformed = await asyncio.to_thread(run_transforms, step.gen.transforms, result.text)
            else:
                transformed = apply_transforms((), result.text)
        except BaseException:
            await self.registry.free(engine_index, context_id)
            raise
        if not self.config.prefix_sharing:
            await self.registry.free(engine_index, context_id)
        elif last and self._continued(session, node, prep.prompt, prep.specials):
            # What a consumer continuing this prompt renders is the prompt, then the variable's value.
            value_text = prep.specials.mask(render_value(transformed.value, transformed.kind))
            canonical = prep.specials.encode(engine.tokenizer, prep.prompt + value_text)
            await self.kept.keep_as(engine_index, ns, context_id, held, canonical)
        else:
            await self.kept.keep(engine_index, ns, context_id, held)
        return transformed.value, transformed.kind

    @staticmethod
    def _continued(session: Session, node: StepNode, prompt: str, specials: SpecialText) -> bool:
        """Whether a pending consumer of the step's output continues its prompt: the consumer's text before
        the value is exactly ``prompt`` (a reviewer quoting the writer's prompt and answer)."""
        graph = session.graph
        for consumer in graph.consumers(node.output):
            values = {}
            for var_id in consumer.call.input_vars:
                var = graph.variables.get(var_id)
                if var.value is not None:
                    values[var_id] = specials.mask(render_value(var.value, var.kind))
            if text_before(consumer.call, node.output, values) == prompt:
                return True
        return False

    def _values(
        self, graph: SessionGraph, node: StepNode, progress: _CallProgress | None, specials: SpecialText
    ) -> dict[str, str]:
        """The text of every variable the step's prompt renders: the inputs of this step *and* of the
        call's earlier steps (the prompt repeats them), and the earlier outputs as generated. Input values
        are a user's text: their special-token strings are masked, so they encode as text."""
        values: dict[str, str] = {}
        for step in node.call.steps[: node.id.index + 1]:
            for var_id in input_vars(step):
                var = graph.variables.get(var_id)
                assert var.value is not None, "a ready step has every input, and its earlier steps had theirs"
                values[var_id] = specials.mask(render_value(var.value, var.kind))
        # Earlier outputs of the same call enter the prompt as generated (before transforms): the prompt
        # then continues the previous step's context exactly.
        if progress is not None:
            values.update(progress.raw_outputs)
        return values

    def _fail(
        self, session: Session, node: StepNode, message: str, error_type: str, llm_output: str | None = None
    ) -> None:
        """Fail ``node`` and everything downstream (see `SessionGraph.fail_step`) and wake their waiters."""
        if session.session_id not in self._tasks or node.id not in session.graph:
            return
        for var in session.graph.fail_step(node, message, error_type=error_type, llm_output=llm_output):
            self.waits.settled(session, var.var_id)
        self._calls.pop((session.session_id, node.call.call_id), None)


async def _encode(tokenizer: Any, specials: SpecialText, text: str) -> list[int]:
    if len(text) <= ENCODE_OFF_LOOP_CHARS:
        return specials.encode(tokenizer, text)
    return await asyncio.to_thread(specials.encode, tokenizer, text)


def request_key(session: Session, node: StepNode) -> str:
    return f"{session.session_id}/{node.id.call_id}/{node.id.index}"


def _sampling(sp: SamplingConfig) -> SamplingParams:
    return SamplingParams(**sp.model_dump())
