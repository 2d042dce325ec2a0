"""Tool use: the policy calls tools until it answers without a call; the answer is scored by
the run's reward terms.

Each turn is read by the tool-call parser. Calls that parse are run (concurrently, each bounded
by its own limits) and their results go back as ``tool`` messages; a malformed call, an unknown
tool or a failing tool is an error text in the same place, so the policy reads what went wrong
and the episode goes on. A turn without a call is the final answer. The reward is the answer's
score plus, once per episode, ``tool_call_reward`` for the first call that parsed and ran
cleanly (shaping that teaches the call format; 0 turns it off).
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from megarl.envs.base import EpisodeItem, Message, StepResult
from megarl.envs.single_turn import opening_messages, score_answer
from megarl.envs.tool_parsers.base import ToolCall, ToolCallParser
from megarl.envs.tools.base import Tool, ToolResult
from megarl.rewards.base import RewardFn


class ToolEnvironment:
    def __init__(self, tools: list[Tool], parser: ToolCallParser, reward: RewardFn, tool_call_reward: float = 0.0):
        self.tools = {tool.name: tool for tool in tools}
        self.parser, self.reward, self.tool_call_reward = parser, reward, tool_call_reward
        self.item: EpisodeItem | None = None
        self.rewarded_call = False

    def tool_specs(self) -> list[dict[str, Any]]:
        return [tool.spec() for tool in self.tools.values()]

    async def reset(self, item: EpisodeItem) -> list[Message]:
        self.item, self.rewarded_call = item, False
        return opening_messages(item)

    async def step(self, action: str) -> StepResult:
        if self.item is None:
            raise RuntimeError("ToolEnvironment.step before reset")
        turn = self.parser.parse(action)
        if not turn.has_calls:
            return StepResult([], await score_answer(self.reward, self.item, action), done=True)
        started = time.perf_counter()
        results = await asyncio.gather(*(self._run(call) for call in turn.calls))
        errors = [ToolResult(f"error: {message}", error=True) for message in turn.errors]
        observation = [Message("tool", r.text, name=name) for name, r in
                       [(c.name, r) for c, r in zip(turn.calls, results, strict=True)] + [("error", e) for e in errors]]
        clean = [r for r in results if not r.error]
        reward = 0.0
        if clean and not self.rewarded_call:
            reward, self.rewarded_call = self.tool_call_reward, True
        info = {"tool_calls": float(len(turn.calls) + len(turn.errors)),
                "tool_errors": float(len(turn.errors) + len(results) - len(clean)),
                "tool_seconds": time.perf_counter() - started}
        return StepResult(observation, reward, done=False, info=info)

    async def _run(self, call: ToolCall) -> ToolResult:
        tool = self.tools.get(call.name)
        if tool is None:
            known = ", ".join(sorted(self.tools)) or "none"
            return ToolResult(f"error: no tool named {json.dumps(call.name)} (tools: {known})", error=True)
        return await tool(call.arguments)

    async def close(self) -> None:
        return None
