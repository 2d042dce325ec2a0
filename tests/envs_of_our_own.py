"""An environment and a tool written outside megarl, named in recipes by import path
(``env.kind: envs_of_our_own:GuessNumber``, ``env.tools: [{name: envs_of_our_own:Reverse}]``)."""

from __future__ import annotations

from megarl.envs.base import EpisodeItem, Message, StepResult
from megarl.envs.tools.base import ToolResult


class GuessNumber:
    """Guess the item's number: "higher" / "lower" until right or out of guesses. Every wrong
    guess costs ``penalty`` (a reward per turn); the right one earns 1."""

    def __init__(self, guesses: int = 3, penalty: float = 0.1):
        self.guesses, self.penalty = guesses, penalty
        self.target, self.turn = 0, 0

    async def reset(self, item: EpisodeItem) -> list[Message]:
        self.target, self.turn = int(item.metadata["answer"]), 0
        return [Message("user", item.prompt)]

    async def step(self, action: str) -> StepResult:
        self.turn += 1
        guess = int(action.strip()) if action.strip().lstrip("-").isdigit() else None
        if guess == self.target:
            return StepResult([], 1.0, done=True)
        if self.turn >= self.guesses:
            return StepResult([], -self.penalty, done=True)
        hint = "not a number" if guess is None else ("higher" if guess < self.target else "lower")
        return StepResult([Message("user", hint)], -self.penalty, done=False)

    def tool_specs(self) -> list[dict]:
        return []

    async def close(self) -> None:
        return None


class Reverse:
    """A tool: its text, reversed."""

    name = "reverse"

    def __init__(self, limit: int = 100):
        self.limit = limit

    def spec(self) -> dict:
        return {"type": "function", "function": {"name": "reverse", "description": "reverses text",
                                                 "parameters": {"type": "object",
                                                                "properties": {"text": {"type": "string"}}}}}

    async def __call__(self, arguments: dict) -> ToolResult:
        return ToolResult(str(arguments.get("text", ""))[: self.limit][::-1])


class NotAnEnvironment:
    def __init__(self):
        pass
