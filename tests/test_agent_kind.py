"""``env.kind: package.module:function``: an async agent, told from an Environment class by the
object it names, checked before start with one line naming what is wrong."""

from __future__ import annotations

import pytest
from conftest import assert_env_kind_refused_in_one_line

from megarl.config.schema import EnvConfig, RunConfig
from megarl.envs.agent import load_agent
from megarl.validation.env_checks import env_ranges, env_setting_errors


def not_async(client, item):
    return 1.0


async def three_args(client, item, extra):
    return 1.0


async def with_options(client, item, *, tries: int = 1):
    return float(tries)


NOT_CALLABLE = 3


def test_the_example_agent_loads_and_a_class_or_a_built_in_kind_is_no_agent():
    from megarl.envs.examples.agents import check_your_work

    assert load_agent(EnvConfig(kind="megarl.envs.examples.agents:check_your_work")) is check_your_work
    assert load_agent(EnvConfig(kind="envs_of_our_own:GuessNumber", options={"guesses": 3})) is None
    assert load_agent(EnvConfig(kind="tools")) is None
    assert load_agent(EnvConfig(kind="test_agent_kind:with_options", options={"tries": 2})) is with_options


@pytest.mark.parametrize("kind, options, match", [
    ("test_agent_kind:not_async", {}, "is a function, but not async"),
    ("test_agent_kind:NOT_CALLABLE", {}, "is a int: name an Environment class or an agent"),
    ("test_agent_kind:three_args", {}, "cannot be called as fn\\(client, item\\)"),
    ("test_agent_kind:with_options", {"retries": 2}, "cannot be called as fn\\(client, item, \\*\\*env.options\\)"),
    ("no_such_module_here:agent", {}, "cannot import 'no_such_module_here'"),
    ("test_agent_kind:missing", {}, "has no 'missing'"),
])
def test_what_cannot_be_an_agent_is_refused_in_one_line(kind, options, match):
    assert_env_kind_refused_in_one_line(kind, options, match)


def test_an_agent_run_is_checked_for_what_the_endpoint_cannot_do_yet():
    def errors(**settings):
        cfg = RunConfig(env=EnvConfig(kind="megarl.envs.examples.agents:check_your_work"))
        for dotted, value in settings.items():
            section, name = dotted.split("__")
            setattr(getattr(cfg, section), name, value)
        return env_setting_errors(cfg)

    assert errors() == []
    assert errors(trainer__schedule="opportunistic", rollout__partial="regenerate") == []
    (group,) = errors(rollout__granularity="group")
    assert "rollout.granularity=group" in group
    assert errors(trainer__schedule="opportunistic", rollout__partial="continue") == []  # suspended across syncs
    cfg = RunConfig(env=EnvConfig(kind="megarl.envs.examples.agents:check_your_work", agent_timeout_s=0))
    assert ("env.agent_timeout_s", 0, "(0, inf)") in env_ranges(cfg)


def test_the_environment_factory_points_an_agent_to_the_endpoint():
    from megarl.envs.registry import environment_factory

    with pytest.raises(ValueError, match="rollout endpoint"):
        environment_factory(EnvConfig(kind="megarl.envs.examples.agents:check_your_work"), [])
