"""Prompt items to prompt token ids, with the tokenizer's own chat template.

Ids, not text, go to the rollout engine: vLLM takes token ids, and tokenizing once
here means the ids the policy is trained on are exactly the ids it generated from.

The chat template is rendered to text (``add_generation_prompt=True``: the prompt
ends with the assistant header) and then encoded with ``add_special_tokens=False``,
because the template already writes BOS/role tokens and encoding must not add a
second BOS.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from megarl.data.prompts import PromptItem

Overlong = Literal["error", "filter", "truncate_left"]
OVERLONG = ("error", "filter", "truncate_left")


@dataclass
class TokenizedPrompts:
    ids: list[list[int]]  # one list of prompt token ids per kept item
    kept: list[int]  # index into the input items of each entry of ``ids``
    dropped: list[int]  # indices of items filtered out as too long
    truncated: list[int]  # indices of items shortened from the left


def encode_prompt(tokenizer: Any, item: PromptItem, use_chat_template: bool = True) -> list[int]:
    """Token ids of one prompt.

    Chat ``messages`` always go through the chat template. Plain ``prompt`` text is
    sent as a single user message when ``use_chat_template`` (instruct models), or
    encoded as is, with the tokenizer's special tokens, when not (base models).
    """
    if item.messages is None and not use_chat_template:
        return list(tokenizer(item.prompt)["input_ids"])
    messages = item.messages if item.messages is not None else [{"role": "user", "content": item.prompt}]
    if not getattr(tokenizer, "chat_template", None):
        name = getattr(tokenizer, "name_or_path", type(tokenizer).__name__)
        raise ValueError(f"tokenizer {name} has no chat template; use plain prompts with use_chat_template=False")
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def tokenize_prompts(tokenizer: Any, items: Sequence[PromptItem], max_prompt_len: int,
                     overlong: Overlong = "error", use_chat_template: bool = True) -> TokenizedPrompts:
    """Encodes ``items``; a prompt longer than ``max_prompt_len`` tokens is, by ``overlong``:

    - ``"error"``: refused with an error naming the item and its length (the default:
      silently changing the data is worse than stopping);
    - ``"filter"``: dropped (its index is reported in ``dropped``);
    - ``"truncate_left"``: cut to its last ``max_prompt_len`` tokens. The left, because
      the end holds the question and the assistant header that generation continues
      from; a system prompt at the start is what is lost.
    """
    if overlong not in OVERLONG:
        raise ValueError(f"overlong must be one of {', '.join(OVERLONG)}, got {overlong!r}")
    if not isinstance(max_prompt_len, int) or max_prompt_len < 1:
        raise ValueError(f"max_prompt_len must be a positive integer, got {max_prompt_len!r}")
    result = TokenizedPrompts(ids=[], kept=[], dropped=[], truncated=[])
    for index, item in enumerate(items):
        ids = encode_prompt(tokenizer, item, use_chat_template)
        if len(ids) > max_prompt_len:
            if overlong == "error":
                raise ValueError(f"prompt {index} has {len(ids)} tokens > max_prompt_len {max_prompt_len}; "
                                 "raise max_prompt_len, or set overlong='filter' or 'truncate_left'")
            if overlong == "filter":
                result.dropped.append(index)
                continue
            ids = ids[-max_prompt_len:]
            result.truncated.append(index)
        result.ids.append(ids)
        result.kept.append(index)
    return result
