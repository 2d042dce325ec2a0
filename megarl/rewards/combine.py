"""Reward combinators: weighted sums of reward functions, and clipping."""

from __future__ import annotations

import math
from collections.abc import Sequence

from megarl.rewards.base import RewardFn, RewardInput, check_rewards


def _name(fn: RewardFn) -> str:
    return getattr(fn, "name", None) or type(fn).__name__


class CombinedReward:
    """``sum_k weight_k * fn_k(samples)``, every term computed on the whole batch.

    Each term's output is validated on its own, so a term that returns the wrong
    number of rewards is named in the error rather than hidden in the sum.
    """

    def __init__(self, terms: Sequence[tuple[RewardFn, float]]) -> None:
        if not terms:
            raise ValueError("CombinedReward needs at least one (reward_fn, weight) term")
        checked: list[tuple[RewardFn, float]] = []
        for index, term in enumerate(terms):
            if not isinstance(term, tuple | list) or len(term) != 2:
                raise ValueError(f"CombinedReward: term {index} must be (reward_fn, weight), got {term!r}")
            fn, weight = term
            if not callable(fn):
                raise TypeError(f"CombinedReward: term {index}: {fn!r} is not callable")
            if isinstance(weight, bool) or not isinstance(weight, int | float) or not math.isfinite(weight):
                raise ValueError(f"CombinedReward: term {index} ({_name(fn)}): weight must be a finite "
                                 f"number, got {weight!r}")
            checked.append((fn, float(weight)))
        self.terms = checked

    def components(self, samples: list[RewardInput]) -> list[list[float]]:
        """Each term's unweighted rewards (for logging what drives the total)."""
        return [check_rewards(fn(samples), len(samples), f"{_name(fn)} (term {index})")
                for index, (fn, _) in enumerate(self.terms)]

    def combine(self, components: list[list[float]]) -> list[float]:
        """The weighted sum of :meth:`components`' output."""
        return [sum(weight * rewards[i] for (_, weight), rewards in zip(self.terms, components, strict=True))
                for i in range(len(components[0]) if components else 0)]

    def __call__(self, samples: list[RewardInput]) -> list[float]:
        return self.combine(self.components(samples))


class ClippedReward:
    """``fn``'s rewards clipped to ``[low, high]`` (either bound may be None)."""

    def __init__(self, fn: RewardFn, low: float | None = None, high: float | None = None) -> None:
        if low is None and high is None:
            raise ValueError("ClippedReward needs low, high, or both")
        if low is not None and high is not None and low > high:
            raise ValueError(f"ClippedReward: low {low} > high {high}")
        self.fn = fn
        self.low = low
        self.high = high

    def __call__(self, samples: list[RewardInput]) -> list[float]:
        rewards = check_rewards(self.fn(samples), len(samples), _name(self.fn))
        low = -math.inf if self.low is None else self.low
        high = math.inf if self.high is None else self.high
        return [min(max(r, low), high) for r in rewards]
