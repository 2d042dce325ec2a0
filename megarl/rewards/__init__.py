"""Rewards: verifiable rule-based scorers, remote HTTP scorers, and their combinations."""

from megarl.rewards.base import RewardFn, RewardInput, check_rewards
from megarl.rewards.combine import ClippedReward, CombinedReward
from megarl.rewards.extract import EXTRACTORS, resolve_extractor
from megarl.rewards.remote import RemoteReward, RemoteRewardError
from megarl.rewards.rule import FormatReward, MathVerifyReward, ReasoningGymReward

__all__ = [
    "EXTRACTORS",
    "ClippedReward",
    "CombinedReward",
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
