"""What a tool-call format offers the tool environment: the calls in a policy turn, and the
instructions that teach the format to a model whose chat template has no tool support."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclass
class ParsedTurn:
    """A policy turn read by a parser: the well-formed calls, and a message for each malformed
    one (shown to the policy as an error observation). A turn with neither is a final answer."""

    calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    @property
    def has_calls(self) -> bool:
        return bool(self.calls or self.errors)


class ToolCallParser(Protocol):
    name: str

    def parse(self, text: str) -> ParsedTurn:
        """The tool calls written in ``text`` (a policy turn, special tokens removed)."""
        ...

    def instructions(self, tool_specs: list[dict[str, Any]]) -> str:
        """A system-prompt paragraph that lists the tools and shows the call format."""
        ...
