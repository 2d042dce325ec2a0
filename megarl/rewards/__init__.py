"""Rewards: verifiable rule-based scorers and remote HTTP scorers (a run weighs them: megarl.trainer.rewards)."""

from megarl.rewards.base import RewardFn, RewardInput, check_rewards
from megarl.rewards.extract import EXTRACTORS, resolve_extractor
from megarl.rewards.remote import RemoteReward, RemoteRewardError
from megarl.rewards.rule import FormatReward, MathVerifyReward, ReasoningGymReward

__all__ = [
    "EXTRACTORS",
    "FormatReward",
    "MathVerifyReward",
    "ReasoningGymReward",
    "RemoteReward",
    "RemoteRewardError",
    "RewardFn",
    "RewardInput",
    "check_rewards",
    "resolve_extractor",
]
