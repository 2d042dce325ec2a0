"""Conversations to token ids, for multi-turn episodes, without re-tokenising what the policy said.

An episode's token sequence is built by appending: the opening prompt (the chat template's
rendering of the system and user messages, ending with the assistant header), then each
policy turn exactly as the engine generated it, then each observation's tokens. An observation
is rendered as the difference between two renderings of a fixed stand-in conversation, with and
without the new messages, so it carries exactly what the chat template would put there
(role headers, separators, the next assistant header) and nothing it would put elsewhere.

Where the template ignores ``tools=`` (SmolLM2's, for one), the tool list and the call format
go into the system prompt instead (``tool_instructions``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

# A stand-in conversation: observations are rendered after it; its words never reach the model.
_STAND_IN = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"},
             {"role": "assistant", "content": "A"}]


class ChatRenderer:
    def __init__(self, tokenizer: Any, tool_specs: Sequence[dict[str, Any]] = (), tool_instructions: str = ""):
        self.tokenizer = tokenizer
        self.tool_specs = list(tool_specs)
        self.native_tools = bool(self.tool_specs) and self._template_reads_tools()
        self.tool_instructions = tool_instructions if self.tool_specs and not self.native_tools else ""
        base = self._render(_STAND_IN)
        eos = tokenizer.eos_token
        end = base.rfind("A" + eos)
        if end < 0:
            raise ValueError(f"the chat template does not end an assistant message with {eos!r}; "
                             "multi-turn episodes need a turn to end with the end-of-sequence token")
        # What the template writes after the assistant's end-of-turn token (ChatML: a newline);
        # the policy's turn ends at that token, so this joins it to the next message.
        self.after_turn = base[end + 1 + len(eos):]
        self._base = base

    def opening(self, messages: Sequence[dict[str, str]]) -> list[int]:
        """The prompt ids of an episode's opening messages, ending with the assistant header."""
        messages = [dict(m) for m in messages]
        if self.tool_instructions:
            if messages and messages[0]["role"] == "system":
                messages[0]["content"] = f"{messages[0]['content']}\n\n{self.tool_instructions}"
            else:
                messages.insert(0, {"role": "system", "content": self.tool_instructions})
        text = self._render(messages, add_generation_prompt=True, tools=self.tool_specs if self.native_tools else None)
        return self._encode(text)

    def observation(self, messages: Sequence[dict[str, str]], turn_ended: bool) -> list[int]:
        """The ids inserted after a policy turn: ``messages`` and the next assistant header.
        ``turn_ended``: the turn ended with the end-of-turn token (else it was cut by a limit, and
        the template's end of message is written first)."""
        full = self._render([*_STAND_IN, *messages], add_generation_prompt=True)
        if not full.startswith(self._base):
            raise ValueError("the chat template renders earlier messages differently once more follow; "
                             "observations cannot be appended token-exactly")
        joint = self.after_turn if turn_ended else self.tokenizer.eos_token + self.after_turn
        return self._encode(joint + full[len(self._base):])

    def _render(self, messages: Sequence[dict[str, str]], add_generation_prompt: bool = False,
                tools: list[dict[str, Any]] | None = None) -> str:
        return self.tokenizer.apply_chat_template(list(messages), tools=tools, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _template_reads_tools(self) -> bool:
        probe = [{"role": "user", "content": "U"}]
        return self._render(probe, tools=self.tool_specs) != self._render(probe)
