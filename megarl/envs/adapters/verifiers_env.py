"""``env.kind: verifiers:<environment>``: a ``verifiers`` environment (the Environments Hub
format: a module with ``load_environment(**args)``, loaded by ``vf.load_environment``) plays each
episode with ITS OWN rollout logic (``vf_env.rollout``: its turns, its env responses, its stop
rule) against the rollout endpoint, and ITS OWN rubric scores it (``rubric.score_rollout``); the
rubric's reward is the episode's reward. ``env.options`` are ``load_environment``'s arguments.

The episode's prompt is the run's dataset item (``data``) formatted the environment's way
(``vf_env.format_prompt``: its system prompt and few-shot examples), its answer, task and info
``item.metadata``'s. With ``data.source: verifiers:<environment>`` the items are the
environment's own dataset (``megarl.data.verifiers_source``), so the run trains on its task as
it defines it; any other source must hold the same task (a question and its answer). The
environment is loaded once per process and kept: engines call ``load_agent`` at every episode call.

Pinned to verifiers 0.1.5: from 0.1.6 on the package imports prime-sandboxes (a remote sandbox
client and its RPC stack) at start, from 0.2 the ``renderers`` package, and 0.4.0 declares
openai<3, against our openai 3.x (containers/install-cpu.sh says how it is installed).
"""

from __future__ import annotations

import importlib.util
import inspect
import json
from collections.abc import Callable
from typing import Any

from megarl.config.schema import EnvConfig

PREFIX = "verifiers:"
_LOADED: dict[str, Any] = {}


def _module_name(env_id: str) -> str:
    return env_id.replace("-", "_")  # verifiers' own rule (vf.load_environment)


def check(env: EnvConfig) -> str:
    """The environment id, checked without loading it: verifiers importable, the module found,
    its ``load_environment`` callable with ``env.options``. ValueError, one line, otherwise."""
    env_id = env.kind[len(PREFIX):]
    if not env_id:
        raise ValueError(f"env.kind {env.kind!r} names no environment (verifiers:<environment module>)")
    if importlib.util.find_spec("verifiers") is None:
        raise ValueError(f"env.kind {env.kind!r} needs the verifiers package (pip install --no-deps "
                         "verifiers==0.1.5; see containers/install-cpu.sh)")
    name = _module_name(env_id)
    try:
        found = importlib.util.find_spec(name)
    except ModuleNotFoundError:
        found = None
    if found is None:
        raise ValueError(f"env.kind {env.kind!r}: no module {name!r} is installed (a verifiers environment "
                         "is a module with load_environment)")
    module = importlib.import_module(name)
    loader = getattr(module, "load_environment", None)
    if not callable(loader):
        raise ValueError(f"env.kind {env.kind!r}: module {name!r} has no load_environment function")
    try:
        inspect.signature(loader).bind(**env.options)
    except TypeError as exc:
        raise ValueError(f"env.options do not fit {name}.load_environment: {exc}") from None
    return env_id


def load(env: EnvConfig) -> Any:
    """The loaded environment (once per process and options)."""
    env_id = check(env)
    key = f"{env_id} {json.dumps(env.options, sort_keys=True, default=str)}"
    if key not in _LOADED:
        import verifiers as vf

        try:
            _LOADED[key] = vf.load_environment(env_id, **env.options)
        except Exception as exc:
            raise ValueError(f"env.kind {env.kind!r}: load_environment failed: {exc.__cause__ or exc}") from None
    return _LOADED[key]


def verifiers_agent(env: EnvConfig) -> Callable:
    """The agent that plays one episode of the loaded environment and returns its rubric's reward."""
    vf_env = load(env)

    async def episode(client: Any, item: Any, **_options: Any) -> float:
        prompt = vf_env.format_prompt(item.prompt, vf_env.system_prompt, vf_env.few_shot)
        answer = str(item.metadata.get("answer", ""))
        task = str(item.metadata.get("task", "default"))
        info = dict(item.metadata.get("info") or {})
        sampling = dict(vf_env.sampling_args)  # a copy: verifiers renames max_tokens in place
        completion, state = await vf_env.rollout(client, "policy", prompt, answer, task, info, sampling)
        score = await vf_env.rubric.score_rollout(prompt, completion, answer, state, task, info)
        return float(score.reward)

    return episode
