"""The environment protocol's built-ins, the Hermes tool-call parser and the chat renderer, without
an engine: parsing, error observations, reward shaping, and that inserted observations are exactly
what the model's chat template writes."""

from __future__ import annotations

import asyncio

import pytest

from megarl.data.chat import ChatRenderer
from megarl.envs.base import EpisodeItem, Message
from megarl.envs.single_turn import SingleTurnEnvironment
from megarl.envs.tool_env import ToolEnvironment
from megarl.envs.tool_parsers.hermes import HermesParser
from megarl.envs.tools.base import ToolResult
from megarl.rewards.base import RewardInput


class Upper:
    """A tool for these tests: upper-cases its text; fails on "boom"."""

    name = "upper"

    def spec(self):
        return {"type": "function", "function": {"name": "upper", "description": "upper-cases text",
                                                 "parameters": {"type": "object",
                                                                "properties": {"text": {"type": "string"}}}}}

    async def __call__(self, arguments):
        text = str(arguments.get("text", ""))
        return ToolResult("error: boom", error=True) if text == "boom" else ToolResult(text.upper())


def exact_reward(samples: list[RewardInput]) -> list[float]:
    return [float(s.response.strip() == s.metadata["answer"]) for s in samples]


def run(coro):
    return asyncio.run(coro)


# -- the Hermes parser ---------------------------------------------------------------------------


def test_hermes_parser_reads_calls_and_reports_every_malformed_one():
    parser = HermesParser(max_calls=2)
    turn = parser.parse('ok <tool_call>{"name": "upper", "arguments": {"text": "a"}}</tool_call>')
    assert turn.calls[0].name == "upper" and turn.calls[0].arguments == {"text": "a"} and not turn.errors
    two = parser.parse('<tool_call>{"name": "a", "arguments": "{\\"x\\": 1}"}</tool_call>'
                       '<tool_call>{"name": "b"}</tool_call>')
    assert [(c.name, c.arguments) for c in two.calls] == [("a", {"x": 1}), ("b", {})]
    assert "not valid JSON" in parser.parse("<tool_call>{name: upper}</tool_call>").errors[0]
    assert "no matching" in parser.parse('<tool_call>{"name": "upper"').errors[0]
    assert '"name" string' in parser.parse("<tool_call>[1, 2]</tool_call>").errors[0]
    assert "must be a JSON object" in parser.parse('<tool_call>{"name": "u", "arguments": 3}</tool_call>').errors[0]
    many = parser.parse('<tool_call>{"name": "u"}</tool_call>' * 3)
    assert len(many.calls) == 2 and "at most 2" in many.errors[0]
    assert not parser.parse("The answer is 42.").has_calls


# -- environments ----------------------------------------------------------------------------------


def test_tool_environment_runs_calls_answers_errors_and_scores_the_final_answer():
    env = ToolEnvironment([Upper()], HermesParser(), exact_reward, tool_call_reward=0.25)
    opening = run(env.reset(EpisodeItem("shout hi", {"answer": "HI"}, system_prompt="be loud")))
    assert [m.role for m in opening] == ["system", "user"]
    called = run(env.step('<tool_call>{"name": "upper", "arguments": {"text": "hi"}}</tool_call>'))
    assert not called.done and called.reward == 0.25
    assert called.observation == [Message("tool", "HI", name="upper")]
    assert called.info["tool_calls"] == 1 and called.info["tool_errors"] == 0
    # the shaping reward comes once per episode; malformed and failing calls are observations
    again = run(env.step('<tool_call>{"name": "upper", "arguments": {"text": "boom"}}</tool_call>'
                         '<tool_call>{"name": "nope"}</tool_call><tool_call>{oops}</tool_call>'))
    assert not again.done and again.reward == 0.0 and again.info["tool_errors"] == 3
    texts = [m.content for m in again.observation]
    assert texts[0] == "error: boom" and 'no tool named "nope"' in texts[1] and "not valid JSON" in texts[2]
    final = run(env.step("HI"))
    assert final.done and final.reward == 1.0 and final.observation == []


def test_single_turn_environment_scores_as_the_reward_terms_do():
    env = SingleTurnEnvironment(exact_reward)
    assert [m.content for m in run(env.reset(EpisodeItem("q", {"answer": "7"})))] == ["q"]
    result = run(env.step("7"))
    assert result.done and result.reward == exact_reward([RewardInput("q", "7", {"answer": "7"})])[0] == 1.0


# -- the chat renderer: observations as the template writes them -----------------------------------


@pytest.fixture(scope="module")
def tokenizer(smollm2):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2)


def test_a_conversation_built_turn_by_turn_is_token_for_token_the_chat_templates(tokenizer):
    """Opening + each turn's ids + each observation's ids == the template's rendering of the
    whole conversation, encoded once (the turns are encoded as an engine would emit them: their
    text, then the end-of-turn token)."""
    renderer = ChatRenderer(tokenizer, [Upper().spec()], HermesParser().instructions([Upper().spec()]))
    assert not renderer.native_tools  # SmolLM2's template ignores tools=: they go into the system prompt
    opening = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "shout hi"}]
    turns = ['<tool_call>{"name": "upper", "arguments": {"text": "hi"}}</tool_call>', "HI"]
    observations = [[{"role": "tool", "content": "HI", "name": "upper"}]]
    ids = renderer.opening(opening)
    assert "You can call these tools" in tokenizer.decode(ids) and "be brief" in tokenizer.decode(ids)
    conversation = [{"role": "system", "content": "be brief\n\n" + renderer.tool_instructions}, opening[1]]
    for i, turn in enumerate(turns):
        ids += tokenizer(turn, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        conversation.append({"role": "assistant", "content": turn})
        if i < len(observations):
            ids += renderer.observation(observations[i], turn_ended=True)
            conversation += observations[i]
    whole = tokenizer.apply_chat_template(conversation, tokenize=False)
    expected = tokenizer(whole.removesuffix(renderer.after_turn), add_special_tokens=False)["input_ids"]
    assert ids == expected
    # a turn cut by a limit gets the template's end of message before the observation
    cut = renderer.observation(observations[0], turn_ended=False)
    assert cut[0] == tokenizer.eos_token_id and cut[1:] == renderer.observation(observations[0], turn_ended=True)[:]


# -- an environment and a tool of your own, by import path ----------------------------------------


def test_an_environment_of_your_own_runs_from_its_import_path():
    from megarl.config.schema import EnvConfig
    from megarl.envs.registry import environment_factory

    make = environment_factory(EnvConfig(kind="envs_of_our_own:GuessNumber", options={"guesses": 3}), [])
    first, second = make(), make()  # one instance per episode: no shared state
    assert first is not second

    async def episode(env, actions):
        await env.reset(EpisodeItem("Guess my number", {"answer": "7"}))
        results = [await env.step(a) for a in actions]
        return [(r.reward, r.done, [m.content for m in r.observation]) for r in results]

    assert run(episode(first, ["3", "9", "7"])) == [(-0.1, False, ["higher"]), (-0.1, False, ["lower"]),
                                                    (1.0, True, [])]
    assert run(episode(second, ["x", "1", "2"])) == [(-0.1, False, ["not a number"]), (-0.1, False, ["higher"]),
                                                     (-0.1, True, [])]


def test_a_tool_of_your_own_runs_from_its_import_path():
    from megarl.envs.tools.registry import build_tool

    tool = build_tool("envs_of_our_own:Reverse", {"limit": 4})
    env = ToolEnvironment([tool], HermesParser(), exact_reward)
    run(env.reset(EpisodeItem("reverse it", {"answer": "x"})))
    result = run(env.step('<tool_call>{"name": "reverse", "arguments": {"text": "abcdef"}}</tool_call>'))
    assert [m.content for m in result.observation] == ["dcba"]


@pytest.mark.parametrize("kind,options,message", [
    ("no_such_package.envs:Env", {}, "env.kind: cannot import 'no_such_package.envs'"),
    ("envs_of_our_own:Missing", {}, "env.kind: module 'envs_of_our_own' has no 'Missing'"),
    ("envs_of_our_own:GuessNumber", {"rounds": 3}, "env.kind: env.options do not fit envs_of_our_own:GuessNumber"),
    ("envs_of_our_own:NotAnEnvironment", {}, "lacks reset, step, tool_specs, close"),
    ("tools", {"guesses": 3}, "env.options is for an environment of your own"),
])
def test_an_environment_of_your_own_is_checked_before_start(kind, options, message):
    from megarl.config.schema import EnvConfig, RunConfig, ToolConfig
    from megarl.validation.env_checks import env_setting_errors

    tools = [ToolConfig(name="calculator")] if kind == "tools" else []
    errors = env_setting_errors(RunConfig(env=EnvConfig(kind=kind, options=options, tools=tools)))
    assert len(errors) == 1 and message in errors[0], errors


def test_a_tool_of_your_own_is_checked_before_start():
    from megarl.config.schema import EnvConfig, RunConfig, ToolConfig
    from megarl.validation.env_checks import env_setting_errors

    errors = env_setting_errors(RunConfig(env=EnvConfig(tools=[ToolConfig(name="envs_of_our_own:Reverse",
                                                                           options={"size": 2})])))
    assert errors == ["env.tools[0]: tool 'envs_of_our_own:Reverse' has no option 'size'; options: limit"]
