"""One step's samples as tensors, aligned for next-token log-probabilities.

A sequence is prompt + response, right-padded to the batch's longest. Token-level
tensors ([B, L-1]) are indexed by *label position* k, the prediction of token
k+1 from tokens <= k; ``mask`` marks the positions whose label is a response
token the policy generated (a multi-turn episode's observation tokens are context
only). Samples of one prompt are consecutive (the GRPO group).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from megarl.algorithms.advantages import per_episode
from megarl.config.roles import row_split
from megarl.config.schema import RunConfig
from megarl.rewards.base import RewardInput
from megarl.rollout.episodes import Trajectory
from megarl.rollout.sampling import RolloutSample
from megarl.workers.rank_batch import RankBatch, placeholder_routes


@dataclass
class RolloutBatch:
    tokens: torch.Tensor  # [B, L] long
    seq_lens: torch.Tensor  # [B]
    prompt_lens: torch.Tensor  # [B]
    mask: torch.Tensor  # [B, L-1] float: label position holds a response token
    rollout_logprobs: torch.Tensor  # [B, L-1]: the engine's log-probs of the sampled tokens
    finish_reasons: list[str]
    group_size: int
    # The sampling temperature: the policy that drew the tokens is softmax(logits / T), so the
    # ranks score them, and train on them, at the same T (rollout_logprobs are vLLM's after T).
    temperature: float = 1.0
    # R3: [B, L, layers, k] the experts the engine routed each token to (None: not recorded)
    routes: torch.Tensor | None = None
    # [B] long: the episode of each row, where an episode trains as several rows (an agent that
    # rewrote its history: ``Trajectory.parts``); the group estimators compare episodes, and every
    # row of one gets its advantage. None: row i is sample (episode) i.
    episode_of: torch.Tensor | None = None

    @property
    def size(self) -> int:
        return self.tokens.shape[0]

    @property
    def response_lens(self) -> torch.Tensor:
        return self.seq_lens - self.prompt_lens

    def per_episode(self, values: torch.Tensor) -> torch.Tensor:
        """Per-row values shared by an episode's rows (its score), one per episode."""
        return values if self.episode_of is None else per_episode(values, self.episode_of)

    def to_workers(self) -> RankBatch:
        """What the ranks' scoring passes read."""
        return RankBatch(tokens=self.tokens, mask=self.mask, seq_lens=self.seq_lens, temperature=self.temperature,
                         routes=self.routes)


@dataclass
class Rollout:
    """One batch of samples: what the roles score and train on, the texts rewards read, and
    where it came from (which prompts, which weights)."""

    batch: RolloutBatch
    reward_inputs: list[RewardInput]
    index: int  # the batch's number in the run: step ``index`` trains on it
    version: int  # the policy weight version that generated every token (0: the initial weights)
    prompt_ids: list[int]  # the prompts' indices in the dataset, for accounting across resumes
    groups: list[list[RolloutSample]]  # the engines' samples, as a checkpoint stores them
    # Multi-turn runs (``env``): each sample's episode, in sample order; its environment rewards
    # are the samples' scores. None: single-turn, scored by the reward terms.
    episodes: list[Trajectory] | None = None
    # Partial rollouts (trainer.schedule: opportunistic): each sample's per-token weight versions
    # (``version`` is the oldest of them). None: every token is ``version``'s.
    token_versions: list[list[int]] | None = None
    # The reward terms' scores [B] and each term's values, computed as the batch came in (the
    # rollout service scores ahead of the trainer); None when a reward model's score is needed.
    scored: tuple[torch.Tensor, dict[str, torch.Tensor]] | None = None
    # rollout.granularity=group: seconds from the batch's submission to the first and to the last
    # group's arrival (how much of generation a group's scoring could overlap); None: whole batches
    group_arrival_s: tuple[float, float] | None = None
    # Episodes under the opportunistic schedule: how many times an interruption cut one (each then
    # started over, or was continued, under newer weights: rollout.partial); None otherwise
    interrupted_episodes: int | None = None
    lost_episodes: int | None = None  # episodes cut by an engine's fault and started over elsewhere


def rows_multiple(cfg: RunConfig) -> int:
    """What a batch's row count must be a multiple of for every role to split it over its
    data-parallel ranks, into minibatches of fixed-size micro-batches: the config check asks it of
    prompts_per_step x n (megarl.validation.rl_checks); a batch whose episodes split has more rows."""
    return math.lcm(*(row_split(name, role, cfg.algorithm.minibatches).multiple for name, role in cfg.roles().items()))


def episode_rows(episodes: list[Trajectory], multiple: int = 1) -> tuple[list[Trajectory], list[int]]:
    """Every part of every episode as a row (``Trajectory.parts``: the parts a history rewrite
    closed, then the last), and each row's episode. Rows are padded to a multiple of ``multiple``
    with copies of the last row that train nothing (mask 0, no turns): the ranks split rows evenly."""
    rows = [part for t in episodes for part in t.parts()]
    of = [i for i, t in enumerate(episodes) for _ in t.parts()]
    last, n = rows[-1], len(rows[-1].response_ids)
    while len(rows) % multiple:
        rows.append(Trajectory(list(last.prompt_ids), list(last.response_ids), [0] * n, [0.0] * n,
                               last.finish_reason, last.reward))
        of.append(of[-1])
    return rows, of


def build_batch(groups: list[list[RolloutSample]], pad_id: int, pad_to_multiple: int = 1,
                temperature: float = 1.0, episodes: list[Trajectory] | None = None,
                rows_multiple: int = 1) -> RolloutBatch:
    """Pads every prompt+response to one length (a multiple of ``pad_to_multiple``). ``episodes``
    (each sample's): where one split (``Trajectory.segments``), each of its parts is a row of its
    own (``episode_rows``, padded to ``rows_multiple`` rows) and ``episode_of`` says whose."""
    samples = [s for group in groups for s in group]
    sizes = {len(g) for g in groups}
    if len(sizes) != 1:
        raise ValueError(f"every prompt needs the same number of samples, got {sorted(sizes)}")
    episode_of = None
    if episodes is not None and any(t.segments for t in episodes):
        rows, of = episode_rows(episodes, rows_multiple)
        samples, episode_of = [t.sample() for t in rows], torch.tensor(of)
    lengths = [len(s.prompt_ids) + len(s.response_ids) for s in samples]
    width = -(-max(lengths) // pad_to_multiple) * pad_to_multiple
    batch, labels = len(samples), width - 1
    tokens = torch.full((batch, width), pad_id, dtype=torch.long)
    mask = torch.zeros(batch, labels)
    rollout_lp = torch.zeros(batch, labels)
    for i, s in enumerate(samples):
        seq = s.prompt_ids + s.response_ids
        tokens[i, :len(seq)] = torch.tensor(seq)
        start, stop = len(s.prompt_ids) - 1, len(seq) - 1  # label positions of the response tokens
        mask[i, start:stop] = 1.0 if s.response_mask is None else torch.tensor(s.response_mask, dtype=mask.dtype)
        if s.logprobs:
            rollout_lp[i, start:stop] = torch.tensor(s.logprobs)
    routes = None
    if samples[0].routes is not None:
        first = samples[0].routes
        routes = placeholder_routes(batch, width, first)  # padding's routes
        for i, s in enumerate(samples):
            routes[i, :len(s.routes)] = s.routes
    return RolloutBatch(
        tokens=tokens, seq_lens=torch.tensor(lengths), prompt_lens=torch.tensor([len(s.prompt_ids) for s in samples]),
        mask=mask, rollout_logprobs=rollout_lp, finish_reasons=[s.finish_reason for s in samples],
        group_size=sizes.pop(),
        temperature=temperature, routes=routes, episode_of=episode_of,
    )


def turn_reward_tensor(turns: list[list[list[int]]], observations: list[list[list[int]]],
                       turn_rewards: list[list[float]], batch: RolloutBatch, scores: torch.Tensor) -> torch.Tensor:
    """``[B, L-1]``: each episode's turn rewards on the label position of each turn's last token.

    A response is turn, observation, turn, ... (``turns[i]`` and ``observations[i]`` in order, as
    the episode runner recorded them); turn k's reward goes on its last token. What the turn
    rewards leave of ``scores`` (a penalty added after the environment scored, or the whole
    score of an episode read back without its turn rewards) goes on the last policy token, so
    every row sums to its score.
    """
    out = torch.zeros_like(batch.mask, dtype=torch.float32)
    for i, (episode_turns, episode_obs, rewards) in enumerate(zip(turns, observations, turn_rewards, strict=True)):
        start, cursor = int(batch.prompt_lens[i]) - 1, 0  # label position of response token 0
        for k, turn in enumerate(episode_turns):
            cursor += len(turn)
            if k < len(rewards) and turn:
                out[i, start + cursor - 1] += rewards[k]
            cursor += len(episode_obs[k]) if k < len(episode_obs) else 0
        policy = batch.mask[i].nonzero()
        if len(policy):
            out[i, int(policy[-1])] += float(scores[i]) - float(sum(rewards[:len(episode_turns)]))
    return out
