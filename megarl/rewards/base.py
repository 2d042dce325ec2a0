"""What every reward function takes and returns.

Rewards are batched (a list in, a list out) because the expensive ones are: a
remote scorer or a reward model amortises its cost over many samples per call.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable


@dataclass
class RewardInput:
    """One sample to score.

    ``metadata`` is the dataset item's metadata, passed through untouched: the
    reference answer (``"answer"``), the reasoning-gym entry (``"entry"``), or
    whatever a custom reward needs. It must be JSON-serialisable for remote rewards.
    """

    prompt: str
    response: str
    metadata: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class RewardFn(Protocol):
    def __call__(self, samples: list[RewardInput]) -> list[float]:
        """One finite float per sample, in order."""
        ...


def check_rewards(rewards: Sequence[Any], expected: int, source: str) -> list[float]:
    """Validates a reward function's output: one finite number per sample.

    ``source`` names where the numbers came from (a class, a URL) so that the error
    points at the culprit rather than at the training loop that tripped over it.
    """
    if not isinstance(rewards, Sequence) or isinstance(rewards, str | bytes):
        raise TypeError(f"{source}: rewards must be a list of numbers, got {type(rewards).__name__}")
    if len(rewards) != expected:
        raise ValueError(f"{source}: returned {len(rewards)} rewards for {expected} samples")
    out: list[float] = []
    for i, value in enumerate(rewards):
        # bool is an int subclass; a True reward is almost certainly a bug upstream.
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise TypeError(f"{source}: reward {i} is {value!r} ({type(value).__name__}), not a number")
        if not math.isfinite(value):
            raise ValueError(f"{source}: reward {i} is {value!r}, not finite")
        out.append(float(value))
    return out
