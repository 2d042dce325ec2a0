"""A reward term of the config as a reward function: one place that maps ``rewards[i].kind`` to
its scorer, for the driver's batched scoring and for environments that score final answers."""

from __future__ import annotations

from megarl.config.schema import RewardTermConfig
from megarl.rewards.base import RewardFn, RewardInput, check_rewards

REWARD_KINDS = ("reasoning_gym", "math_verify", "format", "remote", "model")


def build_term(term: RewardTermConfig) -> RewardFn:
    """The scorer of a text term (every kind but ``model``, which the reward model computes)."""
    from megarl.rewards.remote import RemoteReward
    from megarl.rewards.rule import FormatReward, MathVerifyReward, ReasoningGymReward

    if term.kind == "reasoning_gym":
        return ReasoningGymReward(dataset_name=None, extractor=term.extractor)
    if term.kind == "math_verify":
        return MathVerifyReward(extractor=term.extractor)
    if term.kind == "format":
        return FormatReward(extractor=term.extractor)
    if term.kind == "remote":
        return RemoteReward(term.url, timeout_s=term.timeout_s, max_retries=term.max_retries,
                            max_concurrency=term.max_concurrency)
    raise ValueError(f"reward kind {term.kind!r} must be one of {', '.join(REWARD_KINDS)}")


class WeightedText:
    """The weighted sum of the text terms (a ``model`` term is skipped: it needs the driver's
    reward-model group), as one ``RewardFn``."""

    def __init__(self, terms: list[RewardTermConfig]):
        self.scored = [(t, build_term(t)) for t in terms if t.kind != "model"]

    def __call__(self, samples: list[RewardInput]) -> list[float]:
        total = [0.0] * len(samples)
        for i, (term, fn) in enumerate(self.scored):
            values = check_rewards(fn(samples), len(samples), f"rewards[{i}] ({term.kind})")
            total = [t + term.weight * v for t, v in zip(total, values, strict=True)]
        return total
