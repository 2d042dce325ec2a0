"""Tiny agents that talk to the rollout endpoint with the stock ``openai`` client, for
``env.kind: megarl.envs.examples.agents:check_your_work`` (``model_configs/cpu_agent_check.yaml``).

Both ask the dataset item's question, then ask the policy to check its answer, and score the
final answer's last number against ``item.metadata["answer"]``. ``check_your_work`` keeps the
conversation as it is (the second request extends the first: one trajectory);
``restate_and_check`` starts the second request afresh, quoting the first answer inside a new
user message, as an agent that compacts its history does (the session splits there).
``answer_once`` asks once and scores that answer: the in-process ``single_turn`` episode as an
agent (``megarl bench endpoint`` times the two against each other).
"""

from __future__ import annotations

from typing import Any

from megarl.envs.base import EpisodeItem
from megarl.rewards.extract import last_number

CHECK = "Check your work. Give only the final number."


def opening(item: EpisodeItem) -> list[dict[str, Any]]:
    """The item's system prompt, context (``env.prelude``) and question, as chat messages."""
    system = [{"role": "system", "content": item.system_prompt}] if item.system_prompt is not None else []
    return system + [m.to_chat() for m in item.context] + [{"role": "user", "content": item.prompt}]


def score(answer: str | None, item: EpisodeItem) -> float:
    """1.0 where the answer's last number is the reference answer, else 0.0."""
    found = last_number(answer or "")
    try:
        return float(found is not None and float(found) == float(item.metadata["answer"]))
    except (KeyError, TypeError, ValueError):
        return 0.0


async def check_your_work(client: Any, item: EpisodeItem, max_tokens: int = 64) -> float:
    messages = opening(item)
    first = await client.chat.completions.create(model="policy", messages=messages, max_tokens=max_tokens)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": CHECK}]
    second = await client.chat.completions.create(model="policy", messages=messages, max_tokens=max_tokens)
    return score(second.choices[0].message.content, item)


async def restate_and_check(client: Any, item: EpisodeItem, max_tokens: int = 64) -> float:
    first = await client.chat.completions.create(model="policy", messages=opening(item), max_tokens=max_tokens)
    restated = f"{item.prompt}\nA first answer was: {first.choices[0].message.content}\n{CHECK}"
    second = await client.chat.completions.create(model="policy", max_tokens=max_tokens,
                                                  messages=[{"role": "user", "content": restated}])
    return score(second.choices[0].message.content, item)


async def answer_once(client: Any, item: EpisodeItem, max_tokens: int | None = None) -> float:
    limit = {} if max_tokens is None else {"max_tokens": max_tokens}  # None: the run's rollout.max_tokens
    reply = await client.chat.completions.create(model="policy", messages=opening(item), **limit)
    return score(reply.choices[0].message.content, item)
