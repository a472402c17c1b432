"""Output-length predictions for the engines' SJF order: the manager's side of SSJF.

`OutputLengths` owns the server's `LengthPredictor` (`server.serve.length_predictor`): before a step or an
OpenAI request runs, `estimate` predicts its output length from what is known then (the semantic function
and step — the *template* —, the prompt's tail, its length, ``max_tokens`` and stop settings); the prediction
travels to the engine as the request's ``priority`` (lower starts sooner under ``scheduling="sjf"``; an
FCFS engine ignores it); when the request is done, `observe` trains the predictor on its true length.

Members of one task group get one priority — the first member's — so that SJF does not pull a group apart
(Parrot schedules a group as a unit). The state can be loaded from and saved to a file, so a restart does not
forget what the server learned; saving is the caller's (at shutdown), not done on every observation.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from server.engine.sampling import SamplingParams
from server.serve.length_predictor import LengthFeatures, LengthPredictor, features

__all__ = ["PROMPT_TAIL_TOKENS", "LengthEstimate", "OutputLengths", "template_key"]

log = logging.getLogger(__name__)

# Task groups whose priority is remembered: groups are short-lived (their members are placed together),
# so the oldest can be forgotten; bounded whatever clients send.
MAX_GROUPS = 4096
# The prompt's end that features read (`features` reads at most 64 words of it), in characters and, for a
# prompt that comes as token ids, in tokens to decode.
TAIL_CHARS = 1024
PROMPT_TAIL_TOKENS = 256


@dataclass(frozen=True)
class LengthEstimate:
    """A request's predicted output length (tokens), the features it came from, and the priority the
    engine gets (the prediction, or its task group's)."""

    features: LengthFeatures
    predicted: int
    priority: float


def template_key(func_name: str | None, step_index: int) -> str | None:
    """The template a step comes from: its semantic function and which of the call's generations it is
    (each ``{{output}}`` of a multi-output call writes differently). Anonymous calls have none."""
    return None if func_name is None else f"{func_name}#{step_index}"


class OutputLengths:
    """The manager's length predictor, task-group priorities and state file (see the module docstring)."""

    def __init__(self, path: str | Path | None = None) -> None:
        self.path = None if path is None else Path(path)
        if self.path is not None and self.path.exists():
            self.predictor = LengthPredictor.load(self.path)
            log.info("length predictor state loaded from %s", self.path)
        else:
            self.predictor = LengthPredictor()
        self._groups: OrderedDict[str, float] = OrderedDict()

    def estimate(
        self,
        template: str | None,
        prompt: str,
        prompt_tokens: int,
        sampling: SamplingParams,
        group: str | None = None,
    ) -> LengthEstimate:
        """Predict a request's output length; ``group`` (a task group's key) shares one priority."""
        f = features(
            template,
            prompt[-TAIL_CHARS:],
            prompt_tokens,
            sampling.max_tokens,
            has_stop=bool(sampling.stop or sampling.stop_token_ids),
            ignore_eos=sampling.ignore_eos,
        )
        predicted = self.predictor.predict(f)
        priority = float(predicted)
        if group is not None:
            priority = self._groups.setdefault(group, priority)
            self._groups.move_to_end(group)
            while len(self._groups) > MAX_GROUPS:
                self._groups.popitem(last=False)
        return LengthEstimate(f, predicted, priority)

    def observe(self, estimate: LengthEstimate, length: int) -> None:
        """A request predicted by ``estimate`` wrote ``length`` tokens: learn from it."""
        self.predictor.observe(estimate.features, length)

    def save(self) -> None:
        """Write the predictor's state to ``path`` (atomically), when there is one."""
        if self.path is not None:
            self.predictor.save(self.path)
            log.info("length predictor state saved to %s", self.path)
