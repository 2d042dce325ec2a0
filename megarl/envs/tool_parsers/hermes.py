"""The Hermes / Qwen format: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one
JSON object per tag, several tags per turn allowed (the format Qwen2.5/Qwen3 and Hermes chat
templates teach)."""

from __future__ import annotations

import json
import re
from typing import Any

from megarl.envs.tool_parsers.base import ParsedTurn, ToolCall

OPEN, CLOSE = "<tool_call>", "</tool_call>"
# Non-greedy to the first close tag: a turn with two calls gives two matches. An open tag
# with no close tag is a truncated call (reported, not ignored).
_CALL = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)


class HermesParser:
    name = "hermes"

    def __init__(self, max_calls: int = 4):
        self.max_calls = max_calls  # per turn: more is an error, not a flood of tool processes

    def parse(self, text: str) -> ParsedTurn:
        turn = ParsedTurn()
        bodies = _CALL.findall(text)
        if text.count(OPEN) > len(bodies):
            turn.errors.append(f"a {OPEN} tag has no matching {CLOSE}")
        for body in bodies[:self.max_calls]:
            call = _read_call(body)
            if isinstance(call, ToolCall):
                turn.calls.append(call)
            else:
                turn.errors.append(call)
        if len(bodies) > self.max_calls:
            turn.errors.append(f"{len(bodies)} tool calls in one turn; at most {self.max_calls} are run")
        return turn

    def instructions(self, tool_specs: list[dict[str, Any]]) -> str:
        listed = "\n".join(json.dumps(spec["function"] if "function" in spec else spec) for spec in tool_specs)
        example = json.dumps({"name": _first_name(tool_specs), "arguments": {"<argument>": "<value>"}})
        return (f"You can call these tools:\n{listed}\n"
                f"To call a tool, write {OPEN}{example}{CLOSE} and stop; the result comes back in a "
                "tool message. When you have the answer, reply without a tool call.")


def _read_call(body: str) -> ToolCall | str:
    """The call in one tag's body, or what is wrong with it (a message for the policy)."""
    try:
        data = json.loads(body.strip())
    except json.JSONDecodeError as exc:
        return f"tool call is not valid JSON ({exc.msg} at character {exc.pos})"
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return 'tool call must be a JSON object with a "name" string'
    arguments = data.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return f'tool call {data["name"]!r}: "arguments" is not a JSON object'
    if not isinstance(arguments, dict):
        return f'tool call {data["name"]!r}: "arguments" must be a JSON object'
    return ToolCall(data["name"], arguments)


def _first_name(tool_specs: list[dict[str, Any]]) -> str:
    for spec in tool_specs:
        return spec.get("function", spec).get("name", "tool")
    return "tool"
