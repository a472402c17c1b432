"""`SimEngine`: the real engine's bookkeeping with the model replaced by a latency model.

A `SimEngine` *is* an `LLMEngine` — the same command validation, contexts and forks, paged block
accounting, continuous-batching scheduler (token budget, caps, eviction, preemption), stop rules and stats
— except that a step runs no model: `SimRunner` predicts the step's time from its features
(`server.sim.latency.LatencyModel`) and the engine sleeps that long on the event loop's clock (virtual
under `server.sim.run`), then delivers the step's results. The engine runs as an asyncio task instead of a
thread; commands are handled as they arrive.

Generated tokens are deterministic: the token at position ``p`` of any context is ``filler[p % len]``
(filler words of the tokenizer, never an end-of-sequence token), so a generate writes exactly
``max_tokens`` tokens unless a stop string or token ends it, and outputs are identical however requests are
batched.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Literal

import torch

from server.engine.config import EngineConfig, ModelConfig
from server.engine.engine import LLMEngine
from server.engine.engine_core import EngineCore
from server.engine.engine_front import Abort, Sink
from server.engine.errors import EngineDeadError
from server.engine.remote_kv import RemoteRows
from server.engine.scheduler import ScheduledChunk
from server.engine.step_features import step_features
from server.sim.latency import LatencyModel

__all__ = ["SimEngine", "SimRunner"]

log = logging.getLogger(__name__)

_FILLER_TEXT = (
    " the service reads each part of the text and writes a short and clear answer about what it says"
    " so that the next step can use it well"
)


class SimRunner:
    """A `server.engine.engine_core.StepRunner` that computes nothing: it predicts each step's time."""

    def __init__(self, latency: LatencyModel, block_size: int, vocab_size: int, filler: list[int]) -> None:
        if not filler:
            raise ValueError("the simulated engine needs at least one filler token")
        self.latency = latency
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.filler = filler
        self.grouped_decode_steps = 0
        # What the latency model models (its grouped steps' times), not a choice made here.
        self.shared_prefix_decode: Literal["auto", "always", "never"] = (
            "auto" if latency.shared_prefix_decode else "never"
        )
        self.remote_rows: RemoteRows | None = None  # the simulator models no remote KV
        self.scored_rows: dict[int, torch.Tensor] = {}
        self.last_seconds = 0.0  # predicted time of the last `run`

    def run(self, batch: list[ScheduledChunk]) -> torch.Tensor:
        """Predict the step's time; the "hidden state" of each chunk is the token that follows it."""
        features = step_features(batch, self.block_size)
        self.last_seconds = self.latency.seconds(features)
        if self.latency.shared_prefix_decode and features.decode_kv_shared:
            self.grouped_decode_steps += 1
        nxt = [self._next(c.request.context.num_cached + c.num_tokens) for c in batch]
        self.scored_rows = {
            i: torch.tensor(
                [self._next(c.request.context.num_cached + j + 1) for j in range(c.num_tokens)],
                dtype=torch.float32,
            ).unsqueeze(1)
            for i, c in enumerate(batch)
            if c.request.prompt_logprobs is not None
        }
        return torch.tensor(nxt, dtype=torch.float32).unsqueeze(1)

    def wait_for_device(self) -> None:
        """Nothing runs on a device here."""

    def _next(self, position: int) -> int:
        """The token the simulated model predicts at ``position``."""
        return self.filler[position % len(self.filler)]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """A peaked distribution on the chosen token: greedy or not, sampling picks it."""
        out = torch.zeros(hidden.shape[0], self.vocab_size)
        out[torch.arange(hidden.shape[0]), hidden[:, 0].long()] = 100.0
        return out


class _HeldSink(Sink):
    """A sink whose deliveries wait while the engine's step is "running" (they land when it ends)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, stream: bool, engine: SimEngine) -> None:
        super().__init__(loop, stream)
        self._engine = engine

    def _post(self, fn: Any, *args: Any) -> None:
        held = self._engine._held
        if held is not None:
            held.append((fn, args))
        elif not self.loop.is_closed():
            self.loop.call_soon(fn, *args)


def _virtual_now() -> float:
    return asyncio.get_running_loop().time()


class SimEngine(LLMEngine):
    """A simulated engine (see the module docstring). ``config.num_kv_blocks`` defaults to the latency
    model's KV capacity; the model shape (vocabulary, special tokens) comes from ``model_config``."""

    def __init__(
        self,
        latency: LatencyModel,
        tokenizer: Any,
        model_config: ModelConfig,
        config: EngineConfig | None = None,
        model_name: str = "sim",
    ) -> None:
        config = config or EngineConfig(device="cpu")
        num_blocks = config.num_kv_blocks or max(1, latency.kv_tokens // config.block_size)
        filler = [
            t
            for t in tokenizer.encode(_FILLER_TEXT, add_special_tokens=False)
            if t not in set(model_config.eos_token_ids) and t != getattr(tokenizer, "eos_token_id", None)
        ]
        runner = SimRunner(latency, config.block_size, model_config.vocab_size, filler)
        self._sim_runner = runner
        self._dead: BaseException | None = None
        self._loop_of_commands: asyncio.AbstractEventLoop | None = None  # where commands are handled
        # SJF aging waits in simulated seconds: the loop's virtual clock, read when the scheduler runs.
        core = EngineCore(
            runner,
            tokenizer,
            model_config,
            config,
            model_name,
            num_blocks,
            _no_copy,
            self._post_from_thread,
            _virtual_now,
        )
        self._attach(core)
        self._held: list[tuple[Any, tuple[Any, ...]]] | None = None
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self.busy_seconds = 0.0  # simulated time spent in steps

    # The caller side of `LLMEngine`, without the thread: commands are handled at once on the loop.
    def _new_sink(self, stream: bool) -> Sink:
        self._loop_of_commands = asyncio.get_running_loop()
        return _HeldSink(self._loop_of_commands, stream, self)

    def _post(self, command: object) -> None:
        if self._closed or self._dead is not None:
            raise EngineDeadError(f"the simulated engine is not running: {self._dead or 'shut down'}")
        self.core.stalled = False  # anything may have freed room
        self.core.handle(command)
        self._kick()

    def _post_from_thread(self, command: object) -> None:
        """A command from another thread (a compiled grammar): handled on the loop, in its turn."""
        loop = self._loop_of_commands
        if loop is not None and not loop.is_closed() and not self._closed:
            loop.call_soon_threadsafe(self._post, command)

    def _abort(self, sink: Sink) -> None:
        if not sink.future.done() and not self._closed:
            self.core.handle(Abort(sink))
            self._kick()

    def shutdown(self) -> None:
        """Stop stepping; requests in flight fail with `EngineDeadError`."""
        if self._closed:
            return
        self._closed = True
        if self._task is not None:
            self._task.cancel()
        self.core.fail_all(EngineDeadError("the simulated engine was shut down"))

    def _kick(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(), name=f"sim-{self.model_name}")

    async def _run(self) -> None:
        try:
            while True:
                self.core.admit_deferred()
                if self.core.stalled or not self.core.scheduler.has_work:
                    return  # the next command starts a new run
                self._sim_runner.last_seconds = 0.0
                self._held = []
                try:
                    self.core.step()
                finally:
                    held, self._held = self._held, None
                seconds = self._sim_runner.last_seconds
                if seconds > 0:
                    self.busy_seconds += seconds
                    await asyncio.sleep(seconds)
                for fn, args in held:
                    fn(*args)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a bug: fail everyone loudly rather than hang them
            log.exception("simulated engine crashed")
            self._dead = e
            self.core.fail_all(EngineDeadError(f"the simulated engine stopped: {e!r}"))


def _no_copy(src: int, dst: int) -> None:
    """Copy-on-write of a block: there is no KV data to copy in a simulation."""
