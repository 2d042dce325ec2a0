"""Environments by ``env.kind``: each episode gets a fresh instance from the factory this
returns (per-episode state never leaks between episodes). Adding a kind is one module and one
branch here; a recipe's own environment is ``env.kind: package.module:Class``, one instance per
episode made with ``env.options`` (and ``reward=``, the run's text reward terms, when its
constructor takes one); ``package.module:function`` an async agent (``megarl.envs.agent``)."""

from __future__ import annotations

from collections.abc import Callable

from megarl.config.schema import EnvConfig, RewardTermConfig
from megarl.envs.base import Environment

ENV_KINDS = ("single_turn", "tools", "remote")


def environment_factory(env: EnvConfig, rewards: list[RewardTermConfig]) -> Callable[[], Environment]:
    """Builds what every episode shares (tools, parser, reward scorers) once, and returns the
    maker of one episode's environment."""
    from megarl.rewards.combined import RunReward

    if env.kind == "single_turn":
        from megarl.envs.single_turn import SingleTurnEnvironment

        reward = RunReward(rewards)
        return lambda: SingleTurnEnvironment(reward)
    if env.kind == "tools":
        from megarl.envs.tool_env import ToolEnvironment
        from megarl.envs.tool_parsers.registry import build_parser
        from megarl.envs.tools.registry import build_tool

        reward = RunReward(rewards)
        tools = [build_tool(t.name, t.options) for t in env.tools]
        parser = build_parser(env.tool_parser)
        return lambda: ToolEnvironment(tools, parser, reward, env.tool_call_reward)
    if env.kind == "remote":
        from megarl.envs.remote import RemoteEnvironmentService

        service = RemoteEnvironmentService(env.url, timeout_s=env.timeout_s, max_retries=env.max_retries,
                                           max_concurrency=env.max_concurrency)
        return service.episode
    from megarl.utils.imports import is_import_path

    if is_import_path(env.kind):
        return custom_environment(env, rewards)
    raise ValueError(f"env.kind {env.kind!r} must be one of {', '.join(ENV_KINDS)} (or package.module:Class, "
                     "or package.module:async_function)")


def custom_environment(env: EnvConfig, rewards: list[RewardTermConfig]) -> Callable[[], Environment]:
    """The maker of ``env.kind``'s class with ``env.options``; one instance is made and checked
    here, so a missing method or a bad option is refused before any episode runs."""
    import inspect

    from megarl.rewards.combined import RunReward
    from megarl.utils.imports import load_object

    cls = load_object(env.kind)
    if not inspect.isclass(cls):  # an async agent function runs through the endpoint, not as an Environment
        raise ValueError(f"env.kind {env.kind!r} is not a class (an agent function's episodes run through "
                         "the rollout endpoint, megarl.envs.agent)")
    options = dict(env.options)
    if "reward" in inspect.signature(cls).parameters:
        options["reward"] = RunReward(rewards)
    try:
        probe = cls(**options)
    except TypeError as exc:
        raise ValueError(f"env.options do not fit {env.kind}: {exc}") from None
    missing = [m for m in ("reset", "step", "tool_specs", "close") if not callable(getattr(probe, m, None))]
    if missing:
        raise ValueError(f"env.kind {env.kind!r} lacks {', '.join(missing)} (see megarl.envs.base.Environment)")
    return lambda: cls(**options)


def tool_instructions(env: EnvConfig, tool_specs: list[dict]) -> str:
    """The system-prompt paragraph that teaches the tools and their call format (used where the
    chat template has no tool support); empty without tools."""
    if not tool_specs:
        return ""
    from megarl.envs.tool_parsers.registry import build_parser

    return build_parser(env.tool_parser).instructions(tool_specs)
