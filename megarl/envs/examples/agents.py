"""Tiny agents that talk to the rollout endpoint with the stock ``openai`` client, for
``env.kind: megarl.envs.examples.agents:check_your_work`` (``model_configs/cpu_agent_check.yaml``).

Both ask the dataset item's question, then ask the policy to check its answer, and score the
final answer's last number against ``item.metadata["answer"]``. ``check_your_work`` keeps the
conversation as it is (the second request extends the first: one trajectory);
``restate_and_check`` starts the second request afresh, quoting the first answer inside a new
user message, as an agent that compacts its history does (the session splits there).
``answer_once`` asks once and scores that answer: the in-process ``single_turn`` episode as an
agent (``megarl bench endpoint`` times the two against each other). ``answer_within`` asks once
but waits only so long for the answer: an agent with a latency budget, whose client disconnects
when it gives up (the endpoint then aborts the turn at the engine and fails the episode).
"""

from __future__ import annotations

import asyncio
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


async def answer_within(client: Any, item: EpisodeItem, seconds: float = 5.0, max_tokens: int | None = None,
                        then_wait_s: float = 0.0, as_text: bool = False) -> float:
    """``answer_once`` with a budget of ``seconds`` for the answer: past it the client gives up
    (closes its connection) and the agent fails, after ``then_wait_s`` seconds (it goes on with
    other work meanwhile, say; its episode's call waits for it). ``as_text``: the item's prompt
    is sent as it is to ``/v1/completions`` (no chat template), as a base model's agent does."""
    import openai

    limit = {} if max_tokens is None else {"max_tokens": max_tokens}
    patient = client.with_options(timeout=seconds)
    try:
        if as_text:
            answer = (await patient.completions.create(model="policy", prompt=item.prompt, **limit)).choices[0].text
        else:
            reply = await patient.chat.completions.create(model="policy", messages=opening(item), **limit)
            answer = reply.choices[0].message.content
    except openai.APITimeoutError:
        await asyncio.sleep(then_wait_s)
        raise
    return score(answer, item)
