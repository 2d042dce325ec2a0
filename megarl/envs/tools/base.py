"""What every tool offers the tool-use environment: a name, a JSON-schema description for the
chat template, and an async call that turns arguments into the text the policy reads back.

A tool never raises for the policy's mistakes (bad arguments, code that crashes or runs too
long): it answers with an error text, because a malformed call is an observation, not a
failure of the run. It raises only when the tool itself is broken.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class ToolResult:
    text: str  # what the policy reads (bounded by the tool's own output limit)
    error: bool = False  # the call failed (bad arguments, a crash, a limit hit)
    seconds: float = 0.0  # wall time of the call


class Tool(Protocol):
    name: str

    def spec(self) -> dict[str, Any]:
        """OpenAI-style function spec: ``{"type": "function", "function": {"name", "description",
        "parameters": <JSON schema>}}``, as chat templates' ``tools=`` take it."""
        ...

    async def __call__(self, arguments: dict[str, Any]) -> ToolResult: ...
