"""What an environment offers the agent loop: ``reset`` an episode, then ``step`` it with each of
the policy's turns until it says ``done``.

An environment instance holds one episode's state (the agent loop makes one per episode, so
episodes in flight never share state). Both methods are coroutines: a tool or a remote
environment waits without holding the engine, and many episodes wait at once. Observations are
chat messages; the agent loop renders them into tokens with the model's chat template and inserts
them after the policy's own tokens, which it never re-tokenises (``megarl.rollout.episodes``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from megarl.data.prompts import ROLES  # noqa: F401 - the chat roles an observation may take


@dataclass(frozen=True)
class Message:
    """One chat message: ``role`` is system, user, assistant or tool."""

    role: str
    content: str
    name: str | None = None  # a tool message: the tool that answered

    def to_chat(self) -> dict[str, str]:
        """The dict a Hugging Face chat template reads."""
        out = {"role": self.role, "content": self.content}
        if self.name is not None:
            out["name"] = self.name
        return out


@dataclass(frozen=True)
class EpisodeItem:
    """What an episode starts from: the dataset item's prompt text and its metadata (the
    reference answer, a reasoning-gym entry, ...), JSON-serialisable for remote environments."""

    prompt: str
    metadata: dict[str, Any] = field(default_factory=dict)
    system_prompt: str | None = None
    # Messages between the system prompt and the prompt: a worked example of a tool call, say
    # (small models imitate a demonstrated exchange far more readily than a described one).
    context: tuple[Message, ...] = ()


@dataclass
class StepResult:
    """The environment's answer to one policy turn."""

    observation: list[Message]  # inserted after the turn (tool results, a user reply); empty when done
    reward: float  # this turn's reward (a done step's reward includes the final one)
    done: bool
    # Counters for the step's metrics, summed over episodes: tool_calls, tool_errors, tool_seconds, ...
    info: dict[str, float] = field(default_factory=dict)


class Environment(Protocol):
    async def reset(self, item: EpisodeItem) -> list[Message]:
        """The episode's opening messages (system and user), from the dataset item."""
        ...

    async def step(self, action: str) -> StepResult:
        """Reacts to the policy's turn (its decoded text, special tokens removed)."""
        ...

    def tool_specs(self) -> list[dict[str, Any]]:
        """The tools the policy may call, as JSON-schema function specs (the chat template's
        ``tools=``); empty for an environment without tools."""
        ...

    async def close(self) -> None:
        """Releases the episode's resources (a remote environment's session)."""
        ...
