"""``env.kind: verifiers:<environment>`` / ``openenv:<environment>`` and ``rollout.endpoint``:
checked before start, one line naming what is wrong. (A verifiers episode through the endpoint:
tests/test_endpoint.py.)"""

from __future__ import annotations

import pytest
from conftest import assert_env_kind_refused_in_one_line

from megarl.config.endpoint import EndpointConfig, endpoint_errors, is_loopback
from megarl.config.schema import EnvConfig, RunConfig
from megarl.envs.agent import load_agent
from megarl.validation.env_checks import env_setting_errors

VF = "verifiers:megarl.envs.examples.vf_chain_sum"


@pytest.mark.parametrize("kind, options, match", [
    ("verifiers:", {}, "names no environment"),
    ("verifiers:no-such-env-here", {}, "no module 'no_such_env_here' is installed"),
    ("verifiers:megarl.envs.examples.agents", {}, "has no load_environment"),
    (VF, {"digits": 2}, "env.options do not fit megarl.envs.examples.vf_chain_sum.load_environment"),
    (VF, {"min_terms": 2, "size": 0}, "load_environment failed"),
])
def test_a_verifiers_environment_that_cannot_load_is_refused_in_one_line(kind, options, match):
    assert_env_kind_refused_in_one_line(kind, options, match)


def test_a_verifiers_environment_is_an_agent_checked_as_one():
    cfg = RunConfig(env=EnvConfig(kind=VF, options={"size": 4}))
    assert callable(load_agent(cfg.env)) and env_setting_errors(cfg) == []
    cfg.rollout.granularity = "group"
    assert ["rollout.granularity=group" in e for e in env_setting_errors(cfg)] == [True]


def test_the_outside_endpoint_needs_a_token_off_loopback():
    assert endpoint_errors(EndpointConfig()) == []  # off
    assert endpoint_errors(EndpointConfig(port=8100)) == []  # loopback, no token needed
    assert endpoint_errors(EndpointConfig(port=8100, host="0.0.0.0", token="t")) == []
    (open_,) = endpoint_errors(EndpointConfig(port=8100, host="0.0.0.0"))
    assert "rollout.endpoint.host='0.0.0.0' is not loopback: set rollout.endpoint.token" in open_
    (port,) = endpoint_errors(EndpointConfig(port=70000))
    assert "rollout.endpoint.port=70000" in port
    assert is_loopback("::1") and is_loopback("127.0.0.2") and is_loopback("localhost")
    assert not is_loopback("10.0.0.1") and not is_loopback("example.org")
    cfg = RunConfig()
    cfg.rollout.endpoint = EndpointConfig(port=8100, host="10.1.2.3")
    (no_token,) = env_setting_errors(cfg)
    assert "rollout.endpoint.token" in no_token


def test_the_outside_endpoint_port_in_use_or_colocated_is_refused_in_one_line():
    import socket

    with socket.socket() as taken:  # a server already listening there
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cfg = RunConfig()
        cfg.rollout.endpoint = EndpointConfig(port=port)
        assert env_setting_errors(cfg) == [f"rollout.endpoint.port={port}: cannot serve on 127.0.0.1:{port} (in use)"]
    assert env_setting_errors(cfg) == []  # free again: served
    cfg.rollout.colocate_with = "actor"
    (colocated,) = env_setting_errors(cfg)
    assert "needs engines of their own (rollout.colocate_with unset)" in colocated


OE = "openenv:megarl.envs.examples.openenv_sums"


@pytest.mark.parametrize("kind, options, match", [
    ("openenv:", {}, "names no environment"),
    ("openenv:no_such_env_here", {}, "cannot import 'no_such_env_here'"),
    (OE, {"dataset_name": "chain_sum"}, "env.options has dataset_name: an OpenEnv environment takes client"),
    (OE, {"answer_field": "reply"}, "answer_field must name the SumsAction field"),
    (OE, {"prompt_field": "text"}, "prompt_field='text' is not a field of SumsObservation"),
    (OE, {"action": "megarl.config.schema:EnvConfig"}, "env.options.action='megarl.config.schema:EnvConfig' is not"),
    ("openenv:megarl.envs.examples", {}, "name env.options.client \\(the package exports none\\)"),
])
def test_an_openenv_environment_that_cannot_load_is_refused_in_one_line(kind, options, match):
    with pytest.raises(ValueError, match=match) as refused:
        load_agent(EnvConfig(kind=kind, options=options))
    assert "\n" not in str(refused.value)
    errors = env_setting_errors(RunConfig(env=EnvConfig(kind=kind, options=options)))
    assert len(errors) == 1 and "\n" not in errors[0]


def test_an_openenv_environment_is_found_from_its_package():
    from megarl.envs.adapters.openenv_env import check

    spec = check(EnvConfig(kind=OE))  # nothing started: the server starts with the first episode
    assert (spec.client.__name__, spec.action.__name__, spec.observation.__name__) == (
        "SumsEnv", "SumsAction", "SumsObservation")
    assert spec.environment == "megarl.envs.examples.openenv_sums.server.sums_environment:SumsEnvironment"
    assert (spec.prompt_field, spec.answer_field) == ("question", "answer")


def test_the_example_openenv_environment_asks_a_seeded_sum_and_scores_its_last_number():
    from megarl.envs.examples.openenv_sums import SumsAction
    from megarl.envs.examples.openenv_sums.server.sums_environment import SumsEnvironment

    env = SumsEnvironment()  # in process: the server round trip is tests/test_endpoint.py's
    asked = env.reset(seed=5)
    # reasoning-gym 0.1.25's chain_sum at seed 5 (two one-digit terms), read off by hand
    assert asked.question == "State the final answer to the following arithmetic problem: 8 - 0 =" and not asked.done
    replies = {"8": 1.0, "The answer is 8.": 1.0, "8 - 0 = 8": 1.0, "8.0": 1.0, "8 = 8 - 0": 0.0,
               "8 or 9": 0.0, "80": 0.0, "-8": 0.0, "x8": 0.0, "eight": 0.0, "": 0.0}
    for reply, reward in replies.items():
        env.reset(seed=5)
        scored = env.step(SumsAction(answer=reply))
        assert (scored.reward, scored.done, scored.correct_answer) == (reward, True, "8"), reply
    bigger = env.reset(seed=5, min_terms=3, max_terms=3, min_digits=2, max_digits=2).question
    assert [len(t) for t in bigger.split(":")[1].split()[::2]] == [2, 2, 2]  # "98 + 93 - 77 =": three 2-digit terms
    with pytest.raises(ValueError, match="not \\['digits'\\]"):
        env.reset(seed=5, digits=2)  # a mistyped reset option fails the episode instead of being dropped


@pytest.fixture
def forgets_echo_env():
    """The echo_env modules this test imports are forgotten after it: its folder goes with the
    test (tests/disk_hygiene.py), and test_recipes writes and imports its own."""
    import sys

    yield
    for name in [n for n in sys.modules if n == "echo_env" or n.startswith("echo_env.")]:
        del sys.modules[name]


def test_openenvs_own_echo_environment_is_found_and_scored_as_its_template_says(tmp_path, monkeypatch,
                                                                                  forgets_echo_env):
    # OpenEnv ships its echo environment as the template `openenv init` writes
    # (model_configs/cpu_openenv_echo.yaml trains on it): the adapter finds its classes unchanged
    from openenv_echo import write_echo_env

    from megarl.envs.adapters.openenv_env import check

    write_echo_env(tmp_path, monkeypatch)
    spec = check(EnvConfig(kind="openenv:echo_env", options={"prompt_field": "echoed_message"}))
    assert (spec.client.__name__, spec.action.__name__, spec.answer_field) == ("EchoEnv", "EchoAction", "message")
    assert spec.environment == "echo_env.server.echo_env_environment:EchoEnvironment"
    from echo_env.server.echo_env_environment import EchoEnvironment

    env = EchoEnvironment()  # in process; the served round trip is the recipe's run
    assert env.reset().echoed_message == "Echo Env environment ready!"
    scored = env.step(spec.action(message="hello there"))
    assert (scored.echoed_message, scored.done) == ("hello there", False)
    assert scored.reward == pytest.approx(1.1)  # 0.1 per character, by the template's own rule
    with pytest.raises(ValueError, match="prompt_field='question' is not a field of EchoObservation"):
        check(EnvConfig(kind="openenv:echo_env"))
