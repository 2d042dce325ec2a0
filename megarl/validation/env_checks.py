"""Checks of the ``env`` section (multi-turn episodes); every message names its dotted field.

``env_ranges`` and ``env_setting_errors`` read the config only (they run with the other range
checks, before any process starts); building each tool once here means a bad tool option is
refused with its field's name, not as a traceback from inside a rollout engine.
"""

from __future__ import annotations

import errno

from megarl.config.schema import RunConfig
from megarl.envs.base import ROLES


def env_ranges(cfg: RunConfig) -> list[tuple[str, float | None, str]]:
    """(field, value, interval) of every env number, for ``ranges.out_of_range``."""
    env = cfg.env
    if env is None:
        return []
    return [
        ("env.max_turns", env.max_turns, "[1, inf)"),
        ("env.max_episode_tokens", env.max_episode_tokens, "[1, inf)"),
        ("env.max_concurrent_episodes", env.max_concurrent_episodes, "[1, inf)"),
        ("env.step_timeout_s", env.step_timeout_s, "(0, inf)"),
        ("env.tool_call_reward", env.tool_call_reward, "(-inf, inf)"),
        ("env.timeout_s", env.timeout_s, "(0, inf)"),
        ("env.max_retries", env.max_retries, "[0, inf)"),
        ("env.max_concurrency", env.max_concurrency, "[1, inf)"),
        ("env.agent_timeout_s", env.agent_timeout_s, "(0, inf)"),
    ]


def _endpoint_errors(cfg: RunConfig) -> list[str]:
    from megarl.config.endpoint import endpoint_errors

    bound = cfg.rollout.endpoint
    errors = endpoint_errors(bound)
    if bound.port is None or errors:
        return errors
    if cfg.rollout.colocate_with is not None:
        # colocated engines sleep while the actor trains: an outside turn would find no weights
        errors.append(f"rollout.endpoint.port={bound.port}: the endpoint for outside callers needs engines of their "
                      "own (rollout.colocate_with unset); colocated engines sleep between steps")
    elif problem := _unbindable(bound.host, bound.port):
        errors.append(f"rollout.endpoint.port={bound.port}: cannot serve on {bound.host}:{bound.port} ({problem})")
    return errors


def _unbindable(host: str, port: int) -> str:
    """Why ``host:port`` cannot be served on from this machine ('' where it can): the endpoint's
    actor runs on the driver's node, so a port in use fails here, before any process starts."""
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        return f"the host does not resolve: {exc}"
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        # as the server binds (aiohttp sets it): a port left in TIME_WAIT passes, a listening one not
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as exc:
            return "in use" if exc.errno == errno.EADDRINUSE else exc.strerror or str(exc)
    return ""


def env_setting_errors(cfg: RunConfig) -> list[str]:
    env = cfg.env
    if env is None:
        return _endpoint_errors(cfg)
    from megarl.envs.agent import is_adapter
    from megarl.envs.registry import ENV_KINDS
    from megarl.envs.tool_parsers.registry import PARSERS
    from megarl.utils.imports import is_import_path

    errors: list[str] = []
    if is_import_path(env.kind) or is_adapter(env.kind):  # verifiers:/openenv: load as agents
        from megarl.envs.agent import load_agent
        from megarl.envs.registry import custom_environment

        try:
            if load_agent(env) is None:
                custom_environment(env, cfg.rewards)
            else:
                errors += _agent_errors(cfg)
        except ValueError as exc:
            errors.append(f"env.kind: {exc}")
    elif env.kind not in ENV_KINDS:
        return [f"env.kind={env.kind!r} must be one of {', '.join(ENV_KINDS)} (or package.module:Class, "
                "or package.module:async_function, verifiers:<environment>, openenv:<environment>)"]
    elif env.options:
        errors.append(f"env.options is for an environment of your own (env.kind: package.module:Class), "
                      f"not {env.kind!r}")
    if env.kind == "tools":
        errors += _tool_errors(cfg)
        if env.tool_parser not in PARSERS:
            errors.append(f"env.tool_parser={env.tool_parser!r} must be one of {', '.join(sorted(PARSERS))}")
    elif env.tools:
        errors.append(f"env.tools is set but env.kind={env.kind!r} runs no tools (use kind: tools)")
    if env.kind == "remote":
        from megarl.utils.http_json import url_problem

        if problem := url_problem(env.url):
            errors.append(f"env.url {problem}")
    for i, message in enumerate(env.prelude):
        if not isinstance(message, dict) or message.get("role") not in ROLES or not isinstance(
                message.get("content"), str):
            errors.append(f"env.prelude[{i}] must be a mapping with role ({', '.join(ROLES)}) and content text")
    if any(term.kind == "model" for term in cfg.rewards):
        errors.append("rewards: a model term cannot score episodes (the environment scores them with the text "
                      "terms); remove it or env")
    return errors + _endpoint_errors(cfg)


def _agent_errors(cfg: RunConfig) -> list[str]:
    """What agent episodes (megarl.rollout.endpoint) cannot do yet."""
    errors = []
    if cfg.rollout.granularity == "group":
        errors.append("env.kind names an agent function: rollout.granularity=group cannot serve it yet (use batch)")
    return errors


def _tool_errors(cfg: RunConfig) -> list[str]:
    from megarl.envs.tools.registry import TOOL_NAMES, build_tool

    tools = cfg.env.tools
    if not tools:
        return ["env.tools is empty: kind: tools needs at least one tool (" + ", ".join(TOOL_NAMES) + ")"]
    errors, seen = [], set()
    for i, tool in enumerate(tools):
        if tool.name in seen:
            errors.append(f"env.tools[{i}].name={tool.name!r} is listed twice")
        seen.add(tool.name)
        try:
            build_tool(tool.name, tool.options)
        except (ValueError, TypeError) as exc:
            errors.append(f"env.tools[{i}]: {exc}")
    return errors
