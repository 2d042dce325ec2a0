"""The trivial environment: one policy turn, scored by the run's reward terms, then done.

It is today's one-prompt-one-response rollout in the environment protocol, so an environment
recipe and a plain one score the same answer the same way (``tests/test_envs.py`` checks it)."""

from __future__ import annotations

import asyncio
from typing import Any

from megarl.envs.base import EpisodeItem, Message, StepResult
from megarl.rewards.base import RewardFn, RewardInput, check_rewards


def opening_messages(item: EpisodeItem, system_prompt: str | None = None) -> list[Message]:
    """The system prompt (the item's own, else ``system_prompt``), the item's context and the user's prompt."""
    system = item.system_prompt if item.system_prompt is not None else system_prompt
    return ([Message("system", system)] if system is not None else []) + [*item.context, Message("user", item.prompt)]


async def score_answer(reward: RewardFn, item: EpisodeItem, answer: str) -> float:
    """The reward terms' score of a final answer (in a thread: a remote term blocks)."""
    sample = RewardInput(prompt=item.prompt, response=answer, metadata=item.metadata)
    values = await asyncio.to_thread(reward, [sample])
    return check_rewards(values, 1, "the episode's reward")[0]


class SingleTurnEnvironment:
    def __init__(self, reward: RewardFn):
        self.reward = reward
        self.item: EpisodeItem | None = None

    async def reset(self, item: EpisodeItem) -> list[Message]:
        self.item = item
        return opening_messages(item)

    async def step(self, action: str) -> StepResult:
        if self.item is None:
            raise RuntimeError("SingleTurnEnvironment.step before reset")
        return StepResult([], await score_answer(self.reward, self.item, action), done=True)

    def tool_specs(self) -> list[dict[str, Any]]:
        return []

    async def close(self) -> None:
        return None
