"""Environments by ``env.kind``: each episode gets a fresh instance from the factory this
returns (per-episode state never leaks between episodes). Adding a kind is one module and one
branch here."""

from __future__ import annotations

from collections.abc import Callable

from megarl.config.schema import EnvConfig, RewardTermConfig
from megarl.envs.base import Environment

ENV_KINDS = ("single_turn", "tools", "remote")


def environment_factory(env: EnvConfig, rewards: list[RewardTermConfig]) -> Callable[[], Environment]:
    """Builds what every episode shares (tools, parser, reward scorers) once, and returns the
    maker of one episode's environment."""
    from megarl.rewards.terms import WeightedText

    if env.kind == "single_turn":
        from megarl.envs.single_turn import SingleTurnEnvironment

        reward = WeightedText(rewards)
        return lambda: SingleTurnEnvironment(reward)
    if env.kind == "tools":
        from megarl.envs.tool_env import ToolEnvironment
        from megarl.envs.tool_parsers.registry import build_parser
        from megarl.envs.tools.registry import build_tool

        reward = WeightedText(rewards)
        tools = [build_tool(t.name, t.options) for t in env.tools]
        parser = build_parser(env.tool_parser)
        return lambda: ToolEnvironment(tools, parser, reward, env.tool_call_reward)
    if env.kind == "remote":
        from megarl.envs.remote import RemoteEnvironmentService

        service = RemoteEnvironmentService(env.url, timeout_s=env.timeout_s, max_retries=env.max_retries,
                                           max_concurrency=env.max_concurrency)
        return service.episode
    raise ValueError(f"env.kind {env.kind!r} must be one of {', '.join(ENV_KINDS)}")


def tool_instructions(env: EnvConfig, tool_specs: list[dict]) -> str:
    """The system-prompt paragraph that teaches the tools and their call format (used where the
    chat template has no tool support); empty without tools."""
    if not tool_specs:
        return ""
    from megarl.envs.tool_parsers.registry import build_parser

    return build_parser(env.tool_parser).instructions(tool_specs)
