"""Chat requests whose answers are naturally short or long, for the SSJF experiment (`benchmarks.ssjf`).

Eight instruction kinds ("answer with one word", "yes or no", "name three", "one sentence", "list ten",
"a detailed explanation", "a Python function", "a short story") over everyday topics. An instruct model
answers the first ones in a few tokens and the last ones at length, so a request's output length is a
property of its text — what a length predictor can learn — while no two requests are the same. The kind is
the request's *template* (as a semantic function's name would be). Built offline from the word lists below,
deterministically from a seed; the training and test parts use disjoint topics, so the predictor is tested on
requests it never saw. Every request has the same ``max_tokens`` cap, so the cap says nothing of the length.

The mix (`CHAT_MIX`) is that of a chat service: short asks twice as often as long ones, so a few long answers
make most of the work — the head-of-line blocking shortest-job-first removes. `EVEN_MIX` asks every kind
equally often.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["CHAT_MIX", "EVEN_MIX", "KINDS", "TOPICS", "LengthRequest", "split"]

KINDS: dict[str, str] = {
    "one_word": "Answer with one word only. What is the usual color of {t}?",
    "yes_no": "Answer only yes or no. Can {t} fit inside a kitchen?",
    "name_three": "Name three facts about {t} in one short line.",
    "sentence": "Describe {t} in one short sentence.",
    "list_ten": "List ten different uses of {t}, one per line, numbered.",
    "explain": "Write a detailed explanation of {t}: what it is, how it works, its history, why it matters.",
    "code": "Write a Python function about {t} with a docstring, comments and an example of its use.",
    "story": "Write a short story of several paragraphs about {t}.",
}

# How often each kind is asked, relative to the others.
CHAT_MIX: dict[str, int] = {
    "one_word": 2,
    "yes_no": 2,
    "name_three": 2,
    "sentence": 2,
    "list_ten": 1,
    "explain": 1,
    "code": 1,
    "story": 1,
}
EVEN_MIX: dict[str, int] = dict.fromkeys(KINDS, 1)

TOPICS: tuple[str, ...] = (
    "a bicycle",
    "an apple",
    "the moon",
    "a river",
    "a lighthouse",
    "a violin",
    "a volcano",
    "a library",
    "a bee",
    "a train",
    "a glacier",
    "a candle",
    "a telescope",
    "a desert",
    "a bridge",
    "a piano",
    "a tomato",
    "a windmill",
    "an owl",
    "a compass",
    "a sailboat",
    "a forest",
    "a clock",
    "a dolphin",
    "a castle",
    "a kite",
    "a mountain",
    "a camera",
    "a garden",
    "a penguin",
    "a rainbow",
    "a map",
    "a teapot",
    "a submarine",
    "a cactus",
    "a lantern",
    "a guitar",
    "a snowflake",
    "a tractor",
    "a parrot",
    "a museum",
    "a waterfall",
    "an umbrella",
    "a robot",
    "a pumpkin",
    "a canyon",
    "a feather",
    "a ladder",
    "a whale",
    "a chessboard",
    "a rocket",
    "an island",
    "a bakery",
    "a spider",
    "a hammer",
    "a meadow",
    "a harbor",
    "a turtle",
    "a market",
    "a balloon",
    "a storm",
    "a typewriter",
    "a fox",
    "a cathedral",
)


@dataclass(frozen=True)
class LengthRequest:
    """One chat request: its template (the instruction kind), topic and the user message."""

    kind: str
    topic: str
    message: str

    @property
    def messages(self) -> list[dict[str, str]]:
        return [{"role": "user", "content": self.message}]

    def prompt(self, tokenizer: Any) -> str:
        """The request as ``tokenizer``'s chat template renders it, ready for the model's answer."""
        return str(tokenizer.apply_chat_template(self.messages, add_generation_prompt=True, tokenize=False))


def _requests(
    topics: list[str], count: int, rng: random.Random, mix: Mapping[str, int]
) -> list[LengthRequest]:
    """``count`` requests, each kind in proportion to its weight in ``mix`` (largest remainders), each on a
    topic of ``topics``, in a seeded order."""
    kinds = [kind for kind, n in _apportion(count, mix).items() for _ in range(n)]
    out = [
        LengthRequest(kind, topic, KINDS[kind].format(t=topic))
        for kind in kinds
        for topic in [rng.choice(topics)]
    ]
    rng.shuffle(out)
    return out


def _apportion(count: int, mix: Mapping[str, int]) -> dict[str, int]:
    """``count`` split over the kinds in proportion to their weights; the remainders go to the largest
    fractions (ties: in the mix's order)."""
    total = sum(mix.values())
    exact = {kind: count * weight / total for kind, weight in mix.items()}
    counts = {kind: int(x) for kind, x in exact.items()}
    order = sorted(mix, key=lambda kind: counts[kind] - exact[kind])
    for kind in order[: count - sum(counts.values())]:
        counts[kind] += 1
    return counts


def split(
    train: int, test: int, seed: int = 0, mix: Mapping[str, int] = CHAT_MIX
) -> tuple[list[LengthRequest], list[LengthRequest]]:
    """A training part (warms the predictor) and a test part (measured), on disjoint topics, with the kinds
    weighed by ``mix``."""
    if train < 0 or test < 1:
        raise ValueError(f"need train >= 0 and test >= 1 requests, got train={train}, test={test}")
    unknown = set(mix) - set(KINDS)
    if unknown or not any(w > 0 for w in mix.values()) or any(w < 0 for w in mix.values()):
        raise ValueError(f"a mix weighs kinds of {sorted(KINDS)} with weights >= 0, not {dict(mix)}")
    rng = random.Random(seed)
    topics = list(TOPICS)
    rng.shuffle(topics)
    half = len(topics) // 2
    return _requests(topics[:half], train, rng, mix), _requests(topics[half:], test, rng, mix)
