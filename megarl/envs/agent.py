"""Agents as environments: ``env.kind: package.module:function`` names an async function

    async def agent(client: openai.AsyncOpenAI, item: EpisodeItem, **env.options) -> float

that plays one episode by calling the rollout endpoint through ``client`` (an OpenAI client bound
to the episode's session: ``client.chat.completions.create(model=..., messages=...)``, any model
name) and returns the episode's reward. Every request it makes is a turn, recorded token-exactly
and trained (``megarl.rollout.endpoint``); ``item`` is the dataset item (its prompt, metadata such
as the reference answer, the system prompt and ``env.prelude`` as ``context``).

``verifiers:<environment>`` and ``openenv:<environment>`` name environments of those ecosystems,
played as agents (``megarl.envs.adapters``).

``package.module:Class`` still names an ``Environment`` class (``megarl.envs.registry``): which of
the two ``env.kind`` names is told by the object, a class or a coroutine function.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

from megarl.config.schema import EnvConfig
from megarl.utils.imports import is_import_path, load_object

SIGNATURE = "async def fn(client, item, **env.options) -> float"


ADAPTERS = ("verifiers:", "openenv:")


def is_adapter(kind: str) -> bool:
    """``verifiers:<environment>`` or ``openenv:<environment>``."""
    return kind.startswith(ADAPTERS)


def adapter_agent(env: EnvConfig) -> Callable | None:
    """The agent of an adapted environment, checked (ValueError, one line); None for other kinds."""
    if env.kind.startswith("verifiers:"):
        from megarl.envs.adapters.verifiers_env import verifiers_agent

        return verifiers_agent(env)
    if env.kind.startswith("openenv:"):
        from megarl.envs.adapters.openenv_env import openenv_agent

        return openenv_agent(env)
    return None


def load_agent(env: EnvConfig) -> Callable | None:
    """The agent function ``env.kind`` names, checked; None where ``env.kind`` names no agent (a
    built-in kind, or a class). ValueError, one line, where it cannot be one: not importable, not
    a coroutine function, or not callable with (client, item) and ``env.options``."""
    if (adapter := adapter_agent(env)) is not None:
        return adapter
    if not is_import_path(env.kind):
        return None
    obj = load_object(env.kind)
    if inspect.isclass(obj):
        return None
    if not inspect.iscoroutinefunction(obj):
        what = "a function, but not async" if callable(obj) else f"a {type(obj).__name__}"
        raise ValueError(f"env.kind {env.kind!r} is {what}: name an Environment class or an agent ({SIGNATURE})")
    try:
        inspect.signature(obj).bind(None, None, **env.options)
    except TypeError as exc:
        raise ValueError(f"env.kind {env.kind!r} cannot be called as fn(client, item"
                         f"{', **env.options' if env.options else ''}): {exc} ({SIGNATURE})") from None
    return obj

