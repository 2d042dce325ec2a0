"""The rollout endpoint without an engine: sessions recorded and assembled from hand-made token
lists (extension, splits, limits), the OpenAI request checks, and the whole path (aiohttp server,
the ``openai`` client, agent episodes, the engine link) against a scripted backend that answers
every turn with fixed tokens."""

from __future__ import annotations

import asyncio
import json

import pytest

from megarl.envs.base import EpisodeItem
from megarl.rollout.endpoint.protocol import ApiError, TurnParams, parse_chat, parse_completion
from megarl.rollout.endpoint.sessions import SampledTurn, Session, SessionBook, SessionLimits, SessionSampling


def sampled(ids, stopped=True, version=0, base=-0.5):
    return SampledTurn(list(ids), [base - i / 10 for i in range(len(ids))], stopped, "stop" if stopped else "length",
                       version)


# -- sessions on hand-made token lists ------------------------------------------------------------


def test_turns_that_extend_the_context_assemble_into_one_trajectory():
    s = Session("a", SessionLimits(max_turns=4, max_episode_tokens=100, max_turn_tokens=10, max_model_len=200))
    prompt = [1, 2, 3]
    spec = s.admit(prompt, TurnParams(max_tokens=50))
    assert spec.max_tokens == 10 and spec.temperature == 1.0  # the turn's own limit; the session's sampling
    assert not s.record(prompt, sampled([7, 8, 2], version=3))
    second = [1, 2, 3, 7, 8, 2, 40, 41]  # the context, then an observation of two tokens
    s.admit(second, TurnParams())
    assert not s.record(second, sampled([9, 2], stopped=False, version=4))
    t = s.finish(1.0)
    assert t.prompt_ids == [1, 2, 3] and t.response_ids == [7, 8, 2, 40, 41, 9, 2]
    assert t.response_mask == [1, 1, 1, 0, 0, 1, 1]
    assert t.logprobs == [-0.5, -0.6, -0.7, 0.0, 0.0, -0.5, -0.6]
    assert t.versions == [3, 3, 3, 4, 4, 4, 4]
    assert t.turns == [[7, 8, 2], [9, 2]] and t.observations == [[40, 41]]
    assert t.finish_reason == "length"  # its last turn was cut by a limit
    assert t.reward == 1.0 and t.turn_rewards == [0.0, 1.0] and t.segments == []
    assert t.info == {"endpoint_turns": 2.0, "history_splits": 0.0}
    assert [r.prompt_ids for r in s.turns] == [prompt, second]


def test_a_prompt_that_does_not_extend_the_tokens_splits_the_session_and_is_counted():
    s = Session("b", SessionLimits(max_turns=5, max_episode_tokens=100, max_turn_tokens=10, max_model_len=200))
    for prompt, reply in (([1, 2], [5, 2]), ([1, 2, 5, 2, 9], [6, 2]),  # extends
                          ([1, 3, 5, 2, 9], [7, 2]),  # history rewritten: splits
                          ([1, 3, 5, 2, 9, 7, 2, 11], [8, 2])):  # extends the new trajectory
        s.admit(prompt, TurnParams())
        s.record(prompt, sampled(reply))
    t = s.finish(0.5)
    assert s.splits == 1 and t.info["history_splits"] == 1.0
    assert t.prompt_ids == [1, 3, 5, 2, 9] and t.response_ids == [7, 2, 11, 8, 2] and t.finish_reason == "done"
    (first,) = t.segments
    assert first.prompt_ids == [1, 2] and first.response_ids == [5, 2, 9, 6, 2] and first.turns == [[5, 2], [6, 2]]
    assert first.reward == 0.5 and first.finish_reason == "length"
    # each trajectory's tokens are exactly its turns' prompts and samples: the last turn's prompt + sample
    for traj, last in ((first, s.turns[1]), (t, s.turns[3])):
        assert traj.prompt_ids + traj.response_ids == last.prompt_ids + last.token_ids


def _split_episode(sid: str, reward: float):
    """An episode whose agent rewrote its history once: two parts, each a turn."""
    s = Session(sid, SessionLimits(max_turns=4, max_episode_tokens=100, max_turn_tokens=10, max_model_len=200))
    for prompt, reply in (([1, 2, 3], [5, 6, 2]), ([1, 4, 5, 6, 2, 9], [7, 2])):  # the second rewrote the first
        s.admit(prompt, TurnParams())
        s.record(prompt, sampled(reply))
    return s.finish(reward)


def test_every_part_of_a_split_episode_trains_as_a_row_with_its_episodes_advantage():
    from dataclasses import replace

    import torch

    from megarl.algorithms import get_algorithm
    from megarl.algorithms.base import ScoredBatch
    from megarl.config.schema import EnvConfig, RunConfig
    from megarl.rollout.episodes import episode_metrics
    from megarl.rollout_driver.batch import Rollout, build_batch
    from megarl.rollout_driver.scoring import Scoring

    whole = Session("w", SessionLimits())
    whole.admit([1, 2], TurnParams())
    whole.record([1, 2], sampled([8, 2]))
    # one prompt's group of three episodes: two split (rewards 1 and 0.5), one whole (reward 0)
    episodes = [_split_episode("a", 1.0), _split_episode("b", 0.5), whole.finish(0.0)]
    batch = build_batch([[t.sample() for t in episodes]], pad_id=0, episodes=episodes, rows_multiple=3)
    parts = [p for t in episodes for p in t.parts()]
    assert len(parts) == 5 and batch.size == 6  # a padding row to a multiple of 3 (the ranks split evenly)
    assert batch.episode_of.tolist() == [0, 0, 1, 1, 2, 2] and batch.group_size == 3
    assert episode_metrics(episodes)["env/split_parts"] == 2 and episode_metrics(episodes)["env/trained_rows"] == 5
    for row, part in enumerate(parts):  # each row is its part's tokens exactly: prompt, sampled, log-probs
        n, p = int(batch.seq_lens[row]), len(part.prompt_ids)
        assert batch.tokens[row, :n].tolist() == part.prompt_ids + part.response_ids
        assert batch.mask[row, p - 1:n - 1].tolist() == part.response_mask and batch.mask[row, n - 1:].sum() == 0
        assert batch.rollout_logprobs[row, p - 1:n - 1].tolist() == pytest.approx(part.logprobs)
    assert batch.mask[5].sum() == 0  # the padding row trains nothing
    assert parts[0].prompt_ids + parts[0].response_ids == [1, 2, 3, 5, 6, 2]
    assert parts[1].prompt_ids + parts[1].response_ids == [1, 4, 5, 6, 2, 9, 7, 2]

    cfg = RunConfig()
    rollout = Rollout(batch, [], 0, 0, [0], [[t.sample() for t in episodes]], episodes)
    scores, _ = Scoring(cfg, None).batch(rollout)
    assert scores.tolist() == [1.0, 1.0, 0.5, 0.5, 0.0, 0.0]  # each row its episode's reward
    # by hand, over the group's three episodes (not its five rows): GRPO, mean 0.5 and unbiased std 0.5;
    # RLOO, each score minus the mean of the other two
    by_hand = {"grpo": [(r - 0.5) / (0.5 + 1e-6) for r in (1.0, 0.5, 0.0)], "rloo": [1.0 - 0.25, 0.0, 0.0 - 0.75]}
    for name, expected in by_hand.items():
        scored = ScoredBatch(scores, batch.mask, batch.group_size, episode_of=batch.episode_of)
        est = get_algorithm(name).estimate(cfg.algorithm, scored)
        for row in range(batch.size):
            got = est.advantages[row][batch.mask[row].bool()]
            assert torch.allclose(got, torch.full_like(got, expected[int(batch.episode_of[row])]), atol=1e-6), name
        assert est.advantages[5].abs().sum() == 0
    # dynamic sampling drops a group whose episodes score alike: every row of every episode in it
    alike = ScoredBatch(torch.ones(6), batch.mask, batch.group_size, episode_of=batch.episode_of)
    assert get_algorithm("grpo").estimate(replace(cfg.algorithm, dynamic_sampling=True), alike).mask.sum() == 0
    # per-turn credit: each row's turn rewards sum to its episode's reward, on its own last policy token
    turns = Scoring(RunConfig(env=EnvConfig(credit="turn")), None).turn_rewards(rollout, scores)
    assert turns.sum(dim=1).tolist() == [1.0, 1.0, 0.5, 0.5, 0.0, 0.0]  # the padding row: none
    assert turns[0, int(batch.seq_lens[0]) - 2] == 1.0 and turns[1, int(batch.seq_lens[1]) - 2] == 1.0
    # an episode that did not split trains as before: one row, no episode index
    plain = build_batch([[t.sample() for t in episodes[2:]]], pad_id=0, episodes=episodes[2:], rows_multiple=3)
    assert plain.size == 1 and plain.episode_of is None


def test_a_checkpoints_rollout_buffer_keeps_every_part_of_a_split_episode(tmp_path):
    from megarl.rollout_driver.batch import Rollout, build_batch
    from megarl.rollout_driver.buffer import load_buffer, save_buffer

    class Assembler:  # what load_buffer asks of the rollout manager for a finished batch
        def assemble(self, index, version, prompt_ids, groups, episodes=None):
            return Rollout(build_batch(groups, 0, episodes=episodes), [], index, version, prompt_ids, groups, episodes)

    episodes = [_split_episode("a", 1.0), _split_episode("b", 0.5)]
    groups = [[t.sample() for t in episodes]]
    save_buffer(tmp_path, {3: Assembler().assemble(3, 2, [7], groups, episodes)})
    back = load_buffer(tmp_path, Assembler())[3]
    assert back.batch.size == 4 and back.batch.episode_of.tolist() == [0, 0, 1, 1]  # rows = parts, as before
    for was, now in zip(episodes, back.episodes, strict=True):
        assert [(p.prompt_ids, p.response_ids, p.response_mask, p.logprobs, p.turns, p.reward) for p in now.parts()] \
            == [(p.prompt_ids, p.response_ids, p.response_mask, p.logprobs, p.turns, p.reward) for p in was.parts()]


def test_limits_end_a_session_with_a_clear_error():
    lim = SessionLimits(max_turns=2, max_episode_tokens=6, max_turn_tokens=4, max_model_len=12)
    s = Session("c", lim)
    assert s.admit([1, 2, 3], TurnParams()).max_tokens == 4
    s.record([1, 2, 3], sampled([4, 2]))
    spec = s.admit([1, 2, 3, 4, 2, 5, 6], TurnParams())  # 4 response tokens used: 2 left
    assert spec.max_tokens == 2
    s.record([1, 2, 3, 4, 2, 5, 6], sampled([7, 8], stopped=False))
    with pytest.raises(ApiError, match="limit of 2 turns") as turns:
        s.admit([1, 2, 3, 4, 2, 5, 6, 7, 8, 9], TurnParams())
    assert turns.value.status == 400 and turns.value.code == "megarl_session_turns"
    with pytest.raises(ApiError, match="has ended") as ended:
        s.admit([1], TurnParams())
    assert ended.value.status == 410
    assert s.finish(None, "the agent failed: BadRequestError").finish_reason == "turns"  # the limit, not the agent

    tokens = Session("d", lim)
    tokens.admit([1, 2], TurnParams())
    tokens.record([1, 2], sampled([3, 2]))
    with pytest.raises(ApiError, match="used its 6 response tokens"):
        tokens.admit([1, 2, 3, 2, 9, 9, 9, 9], TurnParams())  # the observation alone reaches the limit
    assert tokens.finish(1.0).finish_reason == "length"
    with pytest.raises(ApiError, match="context is 12") as long:
        Session("e", lim).admit(list(range(12)), TurnParams())
    assert long.value.code == "context_length_exceeded"


def test_a_session_past_its_wall_time_ends_with_a_clear_error_and_fails_its_episode():
    now = [100.0]
    s = Session("wall", SessionLimits(wall_s=10.0), clock=lambda: now[0])
    s.admit([1, 2], TurnParams())
    s.record([1, 2], sampled([3, 2]))
    now[0] = 109.5
    assert s.wall_left() == pytest.approx(0.5)
    now[0] = 110.0
    with pytest.raises(ApiError, match="wall-time limit of 10 s") as late:
        s.admit([1, 2, 3, 2, 4], TurnParams())
    assert late.value.status == 400 and late.value.code == "megarl_session_wall_time"
    with pytest.raises(ApiError, match="its 10 s of wall time are used") as after:
        s.admit([1, 2, 3, 2, 4], TurnParams())
    assert after.value.status == 410
    t = s.finish(1.0)  # the agent's reward does not count: the episode was cut short
    assert t.finish_reason == "env_error" and t.reward == 0.0 and "wall-time limit" in t.error
    assert t.turns == [[3, 2]] and t.response_ids == [3, 2]  # only the whole turn recorded before
    assert Session("free", SessionLimits(), clock=lambda: now[0]).wall_left() is None


def test_a_training_session_refuses_another_temperature_and_seeds_each_turn():
    s = Session("f", SessionLimits(), SessionSampling(temperature=0.7, top_p=1.0, seed=100))
    with pytest.raises(ApiError, match="temperature is fixed at 0.7"):
        s.admit([1], TurnParams(temperature=1.0))
    assert s.admit([1], TurnParams(temperature=0.7)).seed == 100
    s.record([1], sampled([2]))
    assert s.admit([1, 2, 3], TurnParams()).seed == 101
    assert s.admit([1, 2, 3], TurnParams(seed=5)).seed == 5  # the request's own
    free = Session("g", SessionLimits(), SessionSampling(fixed=False))
    assert free.admit([1], TurnParams(temperature=0.2, top_p=0.5)).temperature == 0.2


def test_an_agent_that_makes_no_request_or_fails_gives_an_env_error_episode():
    assert Session("h", SessionLimits()).finish(1.0).finish_reason == "env_error"
    s = Session("i", SessionLimits())
    s.admit([1], TurnParams())
    s.record([1], sampled([2]))
    t = s.finish(None, "the agent failed: KeyError: 'x'")
    assert t.finish_reason == "env_error" and t.reward == 0.0 and t.turns == [[2]] and "KeyError" in t.error


def test_the_session_book_names_unknown_and_ended_sessions():
    book = SessionBook()
    with pytest.raises(ApiError, match="X-Megarl-Session") as none:
        book.get(None)
    assert none.value.status == 400
    with pytest.raises(ApiError, match="no session 'x'") as unknown:
        book.get("x")
    assert unknown.value.status == 404
    book.open("x", SessionLimits())
    assert book.get("x").id == "x"
    book.close("x")
    with pytest.raises(ApiError, match="has ended") as gone:
        book.get("x")
    assert gone.value.status == 410


@pytest.mark.parametrize("body, match", [
    ([], "must be a JSON object"),
    ({"messages": []}, "messages must be a non-empty list"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "must be an object with a role"),
    ({"messages": [{"role": "user"}]}, "has no content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "only text parts"),
    ({"messages": [{"role": "user", "content": "hi"}], "n": 2}, "n must be 1"),
    ({"messages": [{"role": "user", "content": "hi"}], "stream": True}, "stream is not supported"),
    ({"messages": [{"role": "user", "content": "hi"}], "temperature": 3}, "temperature must be a number in"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, "max_tokens must be an integer >= 1"),
    ({"messages": [{"role": "user", "content": "hi"}], "stop": ["a", "b", "c", "d", "e"]}, "stop must be"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 3}, "needs logprobs: true"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, "tools must be"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"function": {"name": "f", "arguments": "{oops"}}]}]}, "arguments is not JSON"),
])
def test_malformed_chat_requests_are_refused_naming_the_field(body, match):
    with pytest.raises(ApiError, match=match) as refused:
        parse_chat(body)
    assert refused.value.status == 400 and refused.value.body()["error"]["type"] == "invalid_request_error"


def test_requests_are_read_as_templates_read_them():
    chat = parse_chat({"model": "m", "messages": [
        {"role": "developer", "content": [{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}]},
        {"role": "assistant", "content": None, "refusal": None,
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\"x\": 1}"}}]},
        {"role": "tool", "content": "2", "tool_call_id": "c1"}], "stop": "END", "logprobs": True, "top_logprobs": 2,
        "max_completion_tokens": 9, "seed": 4})
    assert chat.messages[0] == {"role": "system", "content": "be brief"}
    assert chat.messages[1]["tool_calls"][0]["function"] == {"name": "f", "arguments": {"x": 1}}
    assert chat.params == TurnParams(max_tokens=9, seed=4, stop=("END",), logprobs=True, top_logprobs=2)
    assert parse_completion({"prompt": [[5, 6]], "logprobs": 1}).prompt == [5, 6]
    with pytest.raises(ApiError, match="prompt must be"):
        parse_completion({"prompt": [1, -2]})
    with pytest.raises(ApiError, match="echo"):
        parse_completion({"prompt": "x", "echo": True})


# -- the whole path: server, openai client, agents, link, against a scripted backend ---------------


class ScriptedBackend:
    """Answers every turn with ``reply`` (then the end-of-turn token), a token per step; log-probs
    count down per request; records every prompt it was given."""

    def __init__(self, reply: list[int], eos: int, delay_s: float = 0.0):
        self.reply, self.eos, self.delay_s = reply, eos, delay_s
        self.open: dict[str, tuple[list[int], int, int]] = {}
        self.prompts: dict[str, list[int]] = {}
        self.sampled: dict[str, list[int]] = {}
        self.aborted: list[str] = []
        self.count = 0

    def add(self, request_id, prompt_ids, spec):
        self.count += 1
        self.open[request_id] = ([], spec.max_tokens, self.count)
        self.prompts[request_id] = list(prompt_ids)

    def step(self):
        import time

        time.sleep(self.delay_s)
        done = []
        for rid, (ids, limit, n) in list(self.open.items()):
            script = self.reply + [self.eos]
            ids.append(script[len(ids)])
            if len(ids) == len(script) or len(ids) == limit:
                del self.open[rid]
                self.sampled[rid] = ids
                stopped = ids[-1] == self.eos
                done.append((rid, SampledTurn(ids, [-n - i / 100 for i in range(len(ids))], stopped,
                                              "stop" if stopped else "length", 0)))
        return done

    def abort(self, request_ids=None):
        ids = [r for r in (list(self.open) if request_ids is None else request_ids) if r in self.open]
        for r in ids:
            del self.open[r]
        self.aborted += ids
        return ids

    def has_unfinished(self):
        return bool(self.open)


@pytest.fixture(scope="module")
def tokenizer(smollm2):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2)


@pytest.fixture(scope="module")
def host(tokenizer):
    from megarl.rollout.endpoint.agents import EndpointHost
    from megarl.rollout.episodes import EventLoopThread

    loop = EventLoopThread()
    h = EndpointHost.start(loop, tokenizer, "scripted")
    yield h
    h.close()
    loop.loop.call_soon_threadsafe(loop.loop.stop)


def run_agent(host, tokenizer, agent, items, backend=None, limits=None, timeout_s=30.0, stop=None, version=7):
    from megarl.rollout.endpoint.agents import AgentEpisodes
    from megarl.rollout.episodes import EpisodeRequest

    backend = backend or ScriptedBackend(tokenizer("The answer is 42.")["input_ids"], tokenizer.eos_token_id)
    episodes = AgentEpisodes(host, agent, {}, limits or SessionLimits(max_turns=3), SessionSampling(seed=10),
                             max_concurrent=4, timeout_s=timeout_s)
    return episodes.run([EpisodeRequest(item, 1000 * i) for i, item in enumerate(items)], backend, version, stop), \
        backend


def test_two_chat_turns_through_the_openai_client_are_one_token_exact_trajectory(host, tokenizer):
    from megarl.envs.examples.agents import CHECK, check_your_work

    items = [EpisodeItem("What is 6 * 7?", {"answer": "42"}), EpisodeItem("What is 5 * 8?", {"answer": "40"})]
    (right, wrong), backend = run_agent(host, tokenizer, check_your_work, items)
    assert (right.reward, wrong.reward) == (1.0, 0.0)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "What is 6 * 7?"}], tokenize=False,
                                         add_generation_prompt=True)
    opening = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert right.prompt_ids == list(opening)
    assert tokenizer.decode(right.observations[0]) == f"\n<|im_start|>user\n{CHECK}<|im_end|>\n<|im_start|>assistant\n"
    assert right.finish_reason == "done" and right.info["history_splits"] == 0 and right.versions == [7] * len(
        right.response_ids)
    # what trains is what the backend was given and sampled, turn by turn
    rids = sorted(backend.prompts, key=lambda r: int(r.rsplit("-", 1)[1]))
    mine = [r for r in rids if backend.prompts[r][:len(opening)] == list(opening)]
    assert len(mine) == 2
    assert backend.prompts[mine[1]] == right.prompt_ids + right.turns[0] + right.observations[0]
    assert right.turns == [backend.sampled[r] for r in mine]
    assert right.prompt_ids + right.response_ids == backend.prompts[mine[1]] + backend.sampled[mine[1]]
    policy = [lp for lp, m in zip(right.logprobs, right.response_mask, strict=True) if m]
    assert len(policy) == sum(len(t) for t in right.turns) and all(lp < 0 for lp in policy)


def test_a_history_rewriting_agent_splits_and_is_counted(host, tokenizer):
    from megarl.envs.examples.agents import restate_and_check
    from megarl.rollout.episodes import episode_metrics

    (t,), backend = run_agent(host, tokenizer, restate_and_check, [EpisodeItem("What is 6 * 7?", {"answer": "42"})])
    assert t.info["history_splits"] == 1.0 and len(t.segments) == 1 and t.reward == 1.0
    assert "A first answer was: The answer is 42." in tokenizer.decode(t.prompt_ids)
    assert len(t.turns) == 1 and t.segments[0].turns == [t.segments[0].response_ids]
    assert episode_metrics([t])["env/history_splits"] == 1.0


async def _raises(client, item):
    await client.chat.completions.create(model="m", messages=[{"role": "user", "content": item.prompt}])
    raise KeyError("no such thing")


async def _returns_text(client, item):
    await client.chat.completions.create(model="m", messages=[{"role": "user", "content": item.prompt}])
    return "1.0"


async def _sleeps(client, item):
    await asyncio.sleep(30)


def test_an_agent_that_fails_fails_its_episode_only(host, tokenizer):
    from megarl.envs.examples.agents import check_your_work

    items = [EpisodeItem("a", {"answer": "42"}), EpisodeItem("b", {"answer": "42"})]
    (failed,), _ = run_agent(host, tokenizer, _raises, items[:1])
    assert failed.finish_reason == "env_error" and "KeyError" in failed.error and len(failed.turns) == 1
    (text,), _ = run_agent(host, tokenizer, _returns_text, items[:1])
    assert text.finish_reason == "env_error" and "not a finite number" in text.error
    (slow,), _ = run_agent(host, tokenizer, _sleeps, items[:1], timeout_s=0.5)
    assert slow.finish_reason == "env_error" and "longer than 0.5 s" in slow.error
    fine, _ = run_agent(host, tokenizer, check_your_work, items)
    assert [t.finish_reason for t in fine] == ["done", "done"]


SEEN: dict[str, list] = {}


async def _probe(client, item):
    """Sends what it is told to, keeping each error's status and message."""
    import openai

    for body in item.metadata["requests"]:
        try:
            await client.chat.completions.create(model="m", **body)
            SEEN.setdefault(item.prompt, []).append("ok")
        except openai.APIStatusError as exc:
            SEEN.setdefault(item.prompt, []).append((exc.status_code, exc.body["message"]))
    return 0.0


def test_an_over_limit_session_and_bad_requests_inside_an_episode_get_clear_errors(host, tokenizer):
    talk = {"messages": [{"role": "user", "content": "hi"}]}
    item = EpisodeItem("limits", {"requests": [talk, {"messages": []}, {**talk, "temperature": 0.3}, talk, talk,
                                               talk]})
    (t,), _ = run_agent(host, tokenizer, _probe, [item], limits=SessionLimits(max_turns=2))
    seen = SEEN["limits"]
    assert seen[0] == "ok" and seen[1][0] == 400 and "messages must be a non-empty list" in seen[1][1]
    assert seen[2][0] == 400 and "temperature is fixed at 1.0" in seen[2][1]
    assert seen[3] == "ok" and seen[4][0] == 400 and "limit of 2 turns" in seen[4][1]
    assert seen[5][0] == 410 and "has ended" in seen[5][1]
    assert t.finish_reason == "turns" and t.info["endpoint_turns"] == 2.0
    # the same opening twice: the second does not extend the first, a trajectory each
    assert t.info["history_splits"] == 1.0 and len(t.turns) == 1 and len(t.segments[0].turns) == 1


def test_a_session_out_of_wall_time_mid_turn_has_the_turn_aborted_and_its_episode_failed(host, tokenizer):
    talk = {"messages": [{"role": "user", "content": "hi"}]}
    # a turn of the scripted reply takes 0.1 s a token, ~0.8 s: past the session's 0.4 s
    backend = ScriptedBackend(tokenizer("The answer is 42.")["input_ids"], tokenizer.eos_token_id, delay_s=0.1)
    (t,), backend = run_agent(host, tokenizer, _probe, [EpisodeItem("wall", {"requests": [talk, talk]})],
                              backend=backend, limits=SessionLimits(max_turns=3, wall_s=0.4))
    seen = SEEN["wall"]
    assert seen[0][0] == 400 and "wall-time limit of 0.4 s (rollout.endpoint.session_wall_s)" in seen[0][1]
    assert seen[1][0] == 410 and "wall time are used" in seen[1][1]
    assert len(backend.aborted) == 1 and not backend.sampled and not backend.open  # stopped at the engine
    assert t.finish_reason == "env_error" and "wall-time limit" in t.error and t.turns == [] and t.reward == 0.0


def test_requests_outside_an_episode_get_clear_errors(host):
    import httpx

    url = host.endpoint.url + "/v1/chat/completions"
    talk = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    with httpx.Client(trust_env=False, timeout=10) as http:
        answers = [http.post(url, json=talk, headers={"X-Megarl-Session": "nobody"}),
                   http.post(url, json=talk),
                   http.post(url, content=b"{not json", headers={"X-Megarl-Session": "nobody"}),
                   http.post(host.endpoint.url + "/v1/completions", json={"prompt": "x", "megarl_session": "nobody"}),
                   http.get(host.endpoint.url + "/v1/models"),
                   http.get(host.endpoint.url + "/v1/nothing")]
    statuses = [a.status_code for a in answers]
    assert statuses == [404, 400, 400, 404, 200, 404]
    messages = [a.json().get("error", {}).get("message", "") for a in answers]
    assert "no session 'nobody'" in messages[0] and "X-Megarl-Session" in messages[1]
    assert "not JSON" in messages[2] and answers[4].json()["data"][0]["id"] == "scripted"
    assert json.loads(answers[5].text)["error"]["message"].startswith("GET /v1/nothing")


async def _gives_up_once(client, item):
    import openai

    await client.completions.create(model="m", prompt="Count: 1 2", max_tokens=2)
    try:
        await client.with_options(timeout=0.3).completions.create(model="m", prompt="Count: 1 2 3")
    except openai.APITimeoutError:
        await asyncio.sleep(0.5)  # the server sees the connection close (a retry at once may come first)
    try:
        await client.completions.create(model="m", prompt="Count: 1 2 3", max_tokens=4)
    except openai.APIStatusError as exc:
        SEEN["gone"] = [(exc.status_code, exc.body["message"])]
    return 1.0


async def _counts_by_text(client, item):
    reply = await client.completions.create(model="m", prompt="Count: 1 2 3", max_tokens=4, logprobs=1)
    more = await client.completions.create(model="m", prompt="Count: 1 2 3" + reply.choices[0].text + " 4",
                                           max_tokens=4)
    return float(len(more.choices[0].text) > 0)


def test_a_client_that_disconnects_mid_request_has_its_turn_aborted_and_its_episode_failed(host, tokenizer):
    backend = ScriptedBackend(tokenizer("The answer is 42.")["input_ids"], tokenizer.eos_token_id, delay_s=0.1)
    (t,), backend = run_agent(host, tokenizer, _gives_up_once, [EpisodeItem("x")], backend=backend)
    assert len(backend.aborted) == 1 and backend.aborted[0] not in backend.sampled  # cut, never recorded
    assert SEEN["gone"][0][0] == 410 and "its client disconnected mid-request" in SEEN["gone"][0][1]
    # a counted failed episode, no reward (whatever the agent returned), its whole first turn only
    assert t.finish_reason == "env_error" and "the client disconnected while its turn generated" in t.error
    assert t.reward == 0.0 and len(t.turns) == 1 and t.info["endpoint_turns"] == 1.0


def test_an_outside_turn_whose_client_left_before_it_reached_an_engine_is_never_sent():
    from types import SimpleNamespace

    from megarl.rollout.endpoint.bound import EngineRouter
    from megarl.rollout.endpoint.sessions import TurnSpec

    async def main():
        calls, answer = [], asyncio.get_running_loop().create_future()

        def endpoint_turns(turns, stop_ids, version):  # an engine call that answers when told to
            calls.append([prompt for prompt, _ in turns])
            return answer

        router = EngineRouter([SimpleNamespace(endpoint_turns=SimpleNamespace(remote=endpoint_turns))], [2], 0)
        spec = TurnSpec(4, 1.0, 1.0)
        first = asyncio.create_task(router.generate([1], spec, "s"))
        await asyncio.sleep(0.05)  # its engine call runs
        second = asyncio.create_task(router.generate([5], spec, "s"))  # queued behind it
        await asyncio.sleep(0.05)
        second.cancel()  # its client went away
        answer.set_result([sampled([3, 2])])
        assert (await first).token_ids == [3, 2]
        await asyncio.sleep(0.05)
        return calls

    assert asyncio.run(main()) == [[[1]]]  # one engine call, the first turn's: the second never went


def test_completions_extend_a_session_by_text(host, tokenizer):
    (t,), _ = run_agent(host, tokenizer, _counts_by_text, [EpisodeItem("x")])
    assert len(t.turns) == 2 and t.info["endpoint_turns"] == 2.0 and t.info["history_splits"] == 0.0
    assert t.prompt_ids == tokenizer("Count: 1 2 3")["input_ids"] and t.finish_reason == "length"
    assert t.observations == [tokenizer(" 4", add_special_tokens=False)["input_ids"]]


def test_an_interruption_drops_the_unfinished_episodes(host, tokenizer):
    from megarl.envs.examples.agents import check_your_work

    pumps = iter(range(10_000))
    backend = ScriptedBackend(tokenizer("The answer is 42.")["input_ids"], tokenizer.eos_token_id, delay_s=0.01)
    out, backend = run_agent(host, tokenizer, check_your_work, [EpisodeItem("a", {"answer": "1"})] * 3,
                             backend=backend, stop=lambda: next(pumps) > 12)
    assert out == [None, None, None] and not backend.open


def test_a_verifiers_environment_plays_through_the_endpoint_and_its_rubric_scores(host, tokenizer):
    # verifiers' own SingleTurnEnv.rollout asks; its own Rubric scores the scripted "42"
    from megarl.config.schema import EnvConfig
    from megarl.envs.agent import load_agent

    agent = load_agent(EnvConfig(kind="verifiers:megarl.envs.examples.vf_chain_sum", options={"size": 4}))
    items = [EpisodeItem("6 + 36 =", {"answer": "42"}), EpisodeItem("6 + 35 =", {"answer": "41"})]
    (right, wrong), backend = run_agent(host, tokenizer, agent, items)
    assert (right.reward, wrong.reward) == (1.0, 0.0) and right.error == ""
    text = tokenizer.apply_chat_template([{"role": "user", "content": "6 + 36 ="}], tokenize=False,
                                         add_generation_prompt=True)
    assert right.prompt_ids == tokenizer(text, add_special_tokens=False)["input_ids"]
    assert right.turns == [tokenizer("The answer is 42.")["input_ids"] + [tokenizer.eos_token_id]]


def test_a_token_bound_endpoint_answers_401_without_it(tokenizer):
    import httpx

    from megarl.rollout.endpoint.agents import EndpointHost
    from megarl.rollout.episodes import EventLoopThread

    loop = EventLoopThread()
    guarded = EndpointHost.start(loop, tokenizer, "guarded", token="s3cret")
    try:
        url = guarded.endpoint.url + "/v1/chat/completions"
        talk = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "megarl_session": "nobody"}
        with httpx.Client(trust_env=False, timeout=10) as http:
            answers = [http.post(url, json=talk), http.post(url, json=talk, headers={"Authorization": "Bearer s3cre"}),
                       http.get(guarded.endpoint.url + "/v1/models"),
                       http.post(url, json=talk, headers={"Authorization": "Bearer s3cret"})]
    finally:
        guarded.close()
        loop.loop.call_soon_threadsafe(loop.loop.stop)
    assert [a.status_code for a in answers] == [401, 401, 401, 404]  # the last one is past the door
    assert "bearer token" in answers[0].json()["error"]["message"]


def test_an_openenv_environment_plays_through_its_own_server_and_client(host, tokenizer, starts_processes):
    # the example environment's server (started here on loopback) asks and scores; the scripted "7"
    import zlib

    import reasoning_gym

    from megarl.config.schema import EnvConfig
    from megarl.envs.adapters import openenv_env
    from megarl.envs.agent import load_agent

    sums = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}
    env = EnvConfig(kind="openenv:megarl.envs.examples.openenv_sums", max_turns=1, options={"reset": sums})

    def answer(prompt):  # what the environment will ask for this item: its seed is the prompt's hash
        return reasoning_gym.create_dataset("chain_sum", size=1, seed=zlib.crc32(prompt.encode()), **sums)[0]["answer"]

    right = next(f"q{i}" for i in range(1000) if answer(f"q{i}") == "7")
    wrong = next(f"q{i}" for i in range(1000) if answer(f"q{i}") != "7")
    backend = ScriptedBackend(tokenizer("7")["input_ids"], tokenizer.eos_token_id)
    try:
        episodes, _ = run_agent(host, tokenizer, load_agent(env), [EpisodeItem(right), EpisodeItem(wrong)], backend)
    finally:
        for server in openenv_env._SERVERS.values():
            server.stop()
        servers, openenv_env._SERVERS = list(openenv_env._SERVERS.values()), {}
    assert [(t.reward, t.error) for t in episodes] == [(1.0, ""), (0.0, "")]
    assert "arithmetic problem" in tokenizer.decode(episodes[0].prompt_ids)
    assert [s.proc.poll() is not None for s in servers] == [True]  # stopped
