"""Rewards: rule-based and remote HTTP scorers, weighed into one reward by megarl.rewards.combined."""

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
