"""Per-turn credit in multi-turn episodes (``env.credit: turn``), against values worked out by hand.

Hand-built episodes (turn, observation, turn) with a reward on each turn: the reward tensor puts
each turn's reward on the turn's last token and any rest of the score on the last policy token;
GRPO, Dr. GRPO and RLOO give a turn's tokens the rewards from that turn on against the group's
baseline (turn 1 exactly the episode advantage); PPO's and REINFORCE++'s per-token rewards are the
turn rewards, so GAE with a zero critic gives each turn its reward-to-go. Observation tokens get
nothing. ``env.credit: episode`` (the default) leaves every estimator as it was.
"""

from __future__ import annotations

import math
import types

import pytest
import torch

from megarl.algorithms import get_algorithm
from megarl.algorithms.advantages import gae
from megarl.algorithms.base import ScoredBatch, token_level_rewards
from megarl.config.schema import AlgorithmConfig, EnvConfig, RunConfig, ToolConfig
from megarl.rollout.episodes import Trajectory
from megarl.rollout_driver.batch import build_batch, turn_reward_tensor
from megarl.rollout_driver.manager import Rollout, RolloutManager

PROMPT = [1, 2, 3]
# (turn lengths, observation lengths, turn rewards): two groups of two episodes
EPISODES = [
    ([2, 3], [2], [0.2, 1.0]),  # a rewarded tool call, then the right answer: 1.2
    ([4], [], [0.0]),  # answered at once, wrongly: 0.0
    ([1, 2, 2], [3, 1], [0.2, 0.0, 1.0]),  # 1.2, the reward split over three turns
    ([3, 1], [2], [0.2, 1.0]),  # 1.2 as well: a group of equal scores
]


def _episode(turn_lens: list[int], obs_lens: list[int], rewards: list[float], seed: int) -> Trajectory:
    g = torch.Generator().manual_seed(seed)
    turns = [torch.randint(10, 90, (n,), generator=g).tolist() for n in turn_lens]
    observations = [torch.randint(10, 90, (n,), generator=g).tolist() for n in obs_lens]
    response, mask = [], []
    for k, turn in enumerate(turns):
        response += turn
        mask += [1] * len(turn)
        if k < len(observations):
            response += observations[k]
            mask += [0] * len(observations[k])
    return Trajectory(list(PROMPT), response, mask, [0.0] * len(response), "done", sum(rewards), turns=turns,
                      observations=observations, turn_rewards=list(rewards))


@pytest.fixture()
def episodes() -> list[Trajectory]:
    return [_episode(*spec, seed=i) for i, spec in enumerate(EPISODES)]


def _turn_of_each_position(t: Trajectory, width: int) -> list[int | None]:
    """The turn index whose token each label position predicts (None: prompt, observation, padding)."""
    out: list[int | None] = [None] * width
    pos = len(t.prompt_ids) - 1
    for k, turn in enumerate(t.turns):
        for _ in turn:
            out[pos] = k
            pos += 1
        pos += len(t.observations[k]) if k < len(t.observations) else 0
    return out


def _scored(episodes: list[Trajectory], scores: torch.Tensor | None = None) -> tuple[ScoredBatch, object]:
    batch = build_batch([[t.sample() for t in episodes[i:i + 2]] for i in (0, 2)], pad_id=0)
    scores = torch.tensor([t.reward for t in episodes]) if scores is None else scores
    turns = turn_reward_tensor([t.turns for t in episodes], [t.observations for t in episodes],
                               [t.turn_rewards for t in episodes], batch, scores)
    return ScoredBatch(scores, batch.mask, 2, turn_rewards=turns), batch


def test_each_turns_reward_sits_on_its_last_token(episodes):
    scored, batch = _scored(episodes)
    for i, t in enumerate(episodes):
        where = _turn_of_each_position(t, batch.mask.shape[1])
        expected = [0.0] * len(where)
        for k in range(len(t.turns)):
            last = max(p for p, turn in enumerate(where) if turn == k)
            expected[last] = t.turn_rewards[k]
        assert scored.turn_rewards[i].tolist() == pytest.approx(expected), i
    assert scored.turn_rewards.sum(dim=1).tolist() == pytest.approx(scored.scores.tolist())


def test_what_the_turn_rewards_leave_of_the_score_goes_on_the_last_policy_token(episodes):
    # a penalty added after the environment scored (the overlong one), and an episode read back
    # from an older checkpoint with its total only
    episodes[1].turn_rewards = []
    scores = torch.tensor([1.2 - 0.5, 0.0, 1.2, 1.2])
    scored, batch = _scored(episodes, scores)
    assert scored.turn_rewards.sum(dim=1).tolist() == pytest.approx(scores.tolist())
    last = int(batch.mask[0].nonzero()[-1])
    assert float(scored.turn_rewards[0, last]) == pytest.approx(1.0 - 0.5)


def _hand_group_advantages(name: str, episodes: list[Trajectory]) -> list[list[float]]:
    """Per turn of each episode: (G_k - baseline) / scale, with the group statistics by hand."""
    out = []
    for g in (0, 2):
        s = [episodes[g].reward, episodes[g + 1].reward]
        mean = sum(s) / 2
        std = math.sqrt(sum((x - mean) ** 2 for x in s) / 1)
        for i in (0, 1):
            t = episodes[g + i]
            to_go = [sum(t.turn_rewards[k:]) for k in range(len(t.turns))]
            if name == "grpo":
                scale = std + 1e-6 if std > 0 else 1.0
                out.append([(G - mean) / scale for G in to_go])
            elif name == "dr_grpo":
                out.append([G - mean for G in to_go])
            else:  # rloo: the other sample is the baseline
                out.append([G - s[1 - i] for G in to_go])
    return out


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo"])
def test_group_estimators_credit_each_turn_with_its_rewards_to_go(name, episodes):
    scored, batch = _scored(episodes)
    cfg = AlgorithmConfig(name=name)
    got = get_algorithm(name).estimate(cfg, scored).advantages
    hand = _hand_group_advantages(name, episodes)
    for i, t in enumerate(episodes):
        where = _turn_of_each_position(t, batch.mask.shape[1])
        expected = [0.0 if k is None else hand[i][k] for k in where]
        assert got[i].tolist() == pytest.approx(expected, abs=1e-5), (name, i)
    # turn 1 of every episode: exactly the episode-level estimator's advantage
    episode_level = get_algorithm(name).estimate(cfg, ScoredBatch(scored.scores, scored.mask, 2)).advantages
    for i, t in enumerate(episodes):
        first = _turn_of_each_position(t, batch.mask.shape[1]).index(0)
        assert float(got[i, first]) == pytest.approx(float(episode_level[i, first]), abs=1e-6)


def test_ppo_rewards_each_turn_and_gae_gives_its_rewards_to_go(episodes):
    scored, batch = _scored(episodes)
    cfg = AlgorithmConfig(name="ppo")
    rewards = token_level_rewards(cfg, scored)
    assert rewards.equal(scored.turn_rewards * scored.mask)
    # a zero critic, gamma = lam = 1: the advantage of a token is the reward still to come
    advantages, _ = gae(rewards, torch.zeros_like(rewards), scored.mask, gamma=1.0, lam=1.0)
    for i, t in enumerate(episodes):
        where = _turn_of_each_position(t, batch.mask.shape[1])
        expected = [0.0 if k is None else sum(t.turn_rewards[k:]) for k in where]
        assert advantages[i].tolist() == pytest.approx(expected), i
    est = get_algorithm("ppo").estimate(cfg, ScoredBatch(scored.scores, scored.mask, 2,
                                                         values=torch.zeros_like(rewards),
                                                         turn_rewards=scored.turn_rewards))
    assert (est.advantages[scored.mask == 0] == 0).all()
    # REINFORCE++ whitens the same returns-to-go over the batch
    rpp = get_algorithm("reinforce_pp").estimate(AlgorithmConfig(name="reinforce_pp"), scored).advantages
    valid = scored.mask.bool()
    whitened = (advantages[valid] - advantages[valid].mean()) / advantages[valid].std()
    assert rpp[valid].tolist() == pytest.approx(whitened.tolist(), abs=1e-5)


def test_episode_credit_is_the_default_and_changes_nothing(episodes):
    cfg = RunConfig(env=EnvConfig(tools=[ToolConfig(name="calculator")]))
    assert cfg.env.credit == "episode"
    batch = build_batch([[t.sample() for t in episodes[i:i + 2]] for i in (0, 2)], pad_id=0)
    rollout = Rollout(batch, [], 1, 0, [0, 1], [], episodes)
    tokenizer = types.SimpleNamespace(pad_token_id=0)
    scores = torch.tensor([t.reward for t in episodes])
    assert RolloutManager(cfg, [], tokenizer, None, None).turn_rewards(rollout, scores) is None
    cfg.env.credit = "turn"
    turns = RolloutManager(cfg, [], tokenizer, None, None).turn_rewards(rollout, scores)
    assert turns.sum(dim=1).tolist() == pytest.approx(scores.tolist())
