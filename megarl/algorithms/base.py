"""What an RL algorithm is to the trainer: the :class:`Algorithm` interface and the typed batches it reads.

An algorithm (one module each, listed in :mod:`megarl.algorithms.registry`) says

- which passes its step needs: the actor's old log-probs, the reference model, a critic;
- which settings it refuses (:meth:`Algorithm.validate`: one line per problem, naming the dotted field);
- how scores become advantages (:meth:`Algorithm.advantages`; :meth:`Algorithm.estimate` adds the
  filters every algorithm shares);
- its policy-gradient loss on a :class:`PolicyMicroBatch` (:meth:`Algorithm.policy_loss`;
  :meth:`Algorithm.loss` adds the shared terms: off-policy correction, KL, entropy), and the metrics
  it emits, each with the way micro-batches and data-parallel shards combine it (:class:`Metric`).

The default policy loss is PPO's clipped surrogate, which GRPO, Dr. GRPO, RLOO, REINFORCE++ and PPO
share; they differ in their advantages. Settings whose default depends on the algorithm (clip range,
aggregation, std normalisation) are resolved when the config is built
(``megarl.config.schema.ALGORITHM_DEFAULTS``), so ``cfg`` here always holds the values in force.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar, Literal

import torch

from megarl.algorithms import losses
from megarl.algorithms.advantages import broadcast, per_episode, token_rewards, turn_advantages
from megarl.algorithms.distill import reverse_kl_advantages
from megarl.algorithms.filters import dynamic_sampling_mask
from megarl.algorithms.kl import kl_reward_penalty
from megarl.algorithms.masked import aggregate
from megarl.algorithms.off_policy import off_policy_correction
from megarl.config.schema import AlgorithmConfig, RunConfig

Reduce = Literal["mean", "sum", "same"]


@dataclass(frozen=True)
class Metric:
    """A metric an update emits, and how its values over micro-batches and data-parallel shards combine:

    - ``"mean"``: the loss computes it as a mean over its micro-batch; :meth:`Algorithm.loss` weighs
      it by the micro-batch's share of the step's global normaliser (:func:`share`), so that the
      weighted values add up (over micro-batches, then shards) to the step's mean;
    - ``"sum"``: already the micro-batch's part of a global total (a loss term under the global
      normaliser): added up;
    - ``"same"``: equal on every rank (gradient norm, learning rate): one value is taken.
    """

    name: str
    reduce: Reduce = "mean"


def combine(values: list[float], reduce: Reduce) -> float:
    """One metric's values over micro-batches or shards -> one value (see :class:`Metric`)."""
    return values[0] if reduce == "same" else sum(values)


# The terms Algorithm.loss adds itself; losses under the global normaliser, so partial sums.
LOSS_METRICS = (Metric("pg_loss", "sum"), Metric("kl_loss", "sum"), Metric("entropy", "sum"))
VALUE_METRICS = (Metric("value_loss", "sum"), Metric("value_clip_fraction"))


@dataclass
class ScoredBatch:
    """The step's batch as the advantage estimators read it; ``[B, T]`` over label positions,
    the ``group_size`` samples of a prompt consecutive."""

    scores: torch.Tensor  # [B] sequence rewards
    mask: torch.Tensor  # [B, T] response tokens
    group_size: int
    old_logprobs: torch.Tensor | None = None  # the actor's before the update (KL in the reward)
    ref_logprobs: torch.Tensor | None = None  # the reference model's
    values: torch.Tensor | None = None  # the critic's
    # Multi-turn episodes with ``env.credit: turn``: each turn's reward on its last policy token,
    # any rest of the score (the overlong penalty, say) on the episode's last; rows sum to ``scores``.
    turn_rewards: torch.Tensor | None = None
    teacher_logprobs: torch.Tensor | None = None  # the teacher role's (on-policy distillation)
    # [B] long: each row's episode where an episode trains as several rows (its parts after a
    # history rewrite); ``scores`` are then per row, equal on an episode's rows, and the groups of
    # ``group_size`` are of episodes. None: row i is episode i.
    episode_of: torch.Tensor | None = None

    @property
    def episode_scores(self) -> torch.Tensor:
        """``[E]``: the score of each episode, the unit a group estimator compares."""
        return self.scores if self.episode_of is None else per_episode(self.scores, self.episode_of)

    def to_rows(self, per_episode_values: torch.Tensor) -> torch.Tensor:
        """``[E]`` -> ``[B]``: every row gets its episode's value (its advantage, whether it is kept)."""
        return per_episode_values if self.episode_of is None else per_episode_values[self.episode_of]


@dataclass
class Estimate:
    """An advantage estimator's result."""

    advantages: torch.Tensor  # [B, T], 0 on masked tokens
    mask: torch.Tensor  # [B, T]: the response tokens the update learns from (dynamic sampling drops groups)
    returns: torch.Tensor | None = None  # [B, T]: the critic's targets, for algorithms with a critic

    def as_dict(self) -> dict[str, torch.Tensor]:
        out = {"mask": self.mask, "advantages": self.advantages}
        return out if self.returns is None else out | {"returns": self.returns}


@dataclass
class PolicyMicroBatch:
    """What the policy loss of one micro-batch reads; token tensors are ``[b, T]``."""

    logprobs: torch.Tensor  # the policy's log-probs of the sampled tokens (differentiated)
    old_logprobs: torch.Tensor  # the behaviour policy's, pi_old (on-policy: ``logprobs`` detached)
    advantages: torch.Tensor  # [b, T], or [b] per sequence
    mask: torch.Tensor  # response tokens (float or bool)
    denom: float  # the minibatch's global normaliser (see ``aggregate``)
    norm_len: float | None = None  # "seq-mean-token-sum"'s constant per-sequence divisor
    ref_logprobs: torch.Tensor | None = None  # the reference model's: KL in the loss
    entropy: torch.Tensor | None = None  # the policy's per-token entropy: entropy bonus
    rollout_logprobs: torch.Tensor | None = None  # the engine's (mu): off-policy correction


@dataclass
class ValueMicroBatch:
    """What the critic's loss of one micro-batch reads; ``[b, T]``."""

    values: torch.Tensor  # the critic's (differentiated)
    old_values: torch.Tensor  # before the update
    returns: torch.Tensor  # targets
    mask: torch.Tensor
    denom: float
    norm_len: float | None = None


def share(mask: torch.Tensor, denom: float, aggregation: str) -> torch.Tensor:
    """This micro-batch's share of the global normaliser: per-micro-batch means times their share,
    summed over micro-batches and data-parallel ranks, give the global mean."""
    if aggregation == "token-mean":
        return mask.float().sum() / denom
    # the seq modes' normaliser counts the sequences with response tokens
    return (mask.sum(dim=1) > 0).float().sum() / denom


def local_mean(x: torch.Tensor, mask: torch.Tensor, aggregation: str) -> torch.Tensor:
    """Mean of per-token ``x`` over the micro-batch, weighted as :func:`share` counts: over tokens
    for "token-mean", over sequences (each its tokens' mean) for the seq modes. Detached."""
    mode = "token-mean" if aggregation == "token-mean" else "seq-mean-token-mean"
    return aggregate(x.detach(), mask, mode)


def token_level_rewards(cfg: AlgorithmConfig, batch: ScoredBatch) -> torch.Tensor:
    """Each sequence's score on its last response token (each turn's reward on the turn's last
    token, with per-turn credit), minus ``kl_coef`` times the k1 KL to the reference on every token
    when ``kl_in_reward`` (the actor's old log-probs are needed then)."""
    if batch.turn_rewards is not None:
        rewards = batch.turn_rewards * batch.mask
    else:
        rewards = token_rewards(batch.scores, batch.mask)
    if cfg.kl_in_reward and batch.ref_logprobs is not None:
        if batch.old_logprobs is None:
            raise ValueError("algorithm.kl_in_reward needs the actor's log-probs before the update")
        if cfg.kl_coef:
            rewards = rewards + kl_reward_penalty(batch.old_logprobs, batch.ref_logprobs, batch.mask, cfg.kl_coef,
                                                  estimator="k1")
    return rewards


class Algorithm:
    """One RL algorithm. Subclasses set ``name`` and implement :meth:`advantages`; the rest has
    defaults (PPO's clipped policy loss, no passes beyond the shared ones, no rules of their own)."""

    name: ClassVar[str]
    min_group_size: ClassVar[int] = 1  # samples per prompt (rollout.n) its advantages compare
    needs_critic: ClassVar[bool] = False
    per_token_rewards: ClassVar[bool] = False  # rewards per token, so KL in the reward applies
    # Whether its advantages may differ between the turns of an episode (env.credit: turn); not
    # for one whose loss reads a single advantage per sequence (GSPO).
    turn_credit: ClassVar[bool] = True
    # what policy_loss returns besides the loss, all micro-batch means
    metrics: ClassVar[tuple[Metric, ...]] = (Metric("clip_fraction"), Metric("approx_kl"), Metric("ratio_mean"))

    # --- the passes a step needs

    def needs_old_logprobs(self, cfg: AlgorithmConfig) -> bool:
        """Whether the step scores the rollout under the actor before updating it. Not when the update
        is one optimizer step over the whole batch (on-policy: its own forward is the behaviour
        policy's) unless the reward needs the actor-reference KL first."""
        return cfg.ppo_epochs > 1 or cfg.minibatches > 1 or cfg.kl_in_reward or self.needs_teacher(cfg)

    def needs_reference(self, cfg: AlgorithmConfig) -> bool:
        return cfg.kl_coef > 0

    def needs_teacher(self, cfg: AlgorithmConfig) -> bool:
        """Whether the teacher role scores the samples (on-policy distillation, ``megarl.algorithms.opd``);
        its advantage term needs the student's log-probs before the update too."""
        return bool(cfg.teacher_kl_coef)

    # --- validation

    def validate(self, run: RunConfig) -> list[str]:
        """The rules every algorithm shares, then its own (:meth:`errors`); one line each."""
        algo, errors = run.algorithm, []
        if self.needs_critic and run.critic is None:
            errors.append(f"algorithm.name={self.name!r} needs a critic role (critic.model.path, or a reward_model "
                          "to start from)")
        if self.min_group_size > 1 and run.rollout.n < self.min_group_size:
            errors.append(f"rollout.n={run.rollout.n}: {self.name} compares samples of a prompt, it needs "
                          f"n >= {self.min_group_size}")
        if self.needs_reference(algo) and run.reference is None:
            errors.append(f"algorithm.kl_coef={algo.kl_coef} needs a reference role")
        if self.needs_teacher(algo) and run.teacher is None:
            errors.append(f"algorithm.teacher_kl_coef={algo.teacher_kl_coef} needs a teacher role (teacher.model.path)")
        elif run.teacher is not None and not self.needs_teacher(algo):
            errors.append(f"teacher is set but algorithm.teacher_kl_coef={algo.teacher_kl_coef}: nothing would read "
                          "its log-probs (algorithm.name: opd, or teacher_kl_coef > 0 beside a task reward)")
        if algo.teacher_kl_coef is not None and algo.teacher_kl_coef < 0:
            errors.append(f"algorithm.teacher_kl_coef={algo.teacher_kl_coef} must be >= 0 (a negative weight "
                          "would push the student away from the teacher)")
        if run.env is not None and run.env.credit == "turn" and not self.turn_credit:
            errors.append(f"env.credit='turn': {self.name} weighs whole sequences by one advantage; use "
                          "env.credit: episode, or another algorithm")
        if algo.kl_in_reward and not self.per_token_rewards:
            # the KL would be computed and dropped: it is in neither the reward nor the loss
            errors.append(f"algorithm.kl_in_reward=True: {self.name} rewards whole sequences, there is no per-token "
                          "reward to put the KL in; set it to false for the KL term in the loss")
        if algo.kl_target is not None and not algo.kl_coef > 0:
            errors.append(f"algorithm.kl_target={algo.kl_target} adapts kl_coef by scaling it, from its first value: "
                          f"kl_coef={algo.kl_coef} would stay there; set kl_coef > 0")
        if algo.is_floor is not None and algo.off_policy_correction not in ("tis", "seq_tis"):
            errors.append(f"algorithm.is_floor={algo.is_floor} bounds truncated importance weights from below; "
                          f"off_policy_correction={algo.off_policy_correction!r} has none (use tis or seq_tis)")
        return errors + self.errors(algo)

    def errors(self, cfg: AlgorithmConfig) -> list[str]:
        """This algorithm's own rules."""
        return []

    # --- advantages

    def estimate(self, cfg: AlgorithmConfig, batch: ScoredBatch) -> Estimate:
        """Dynamic sampling (groups with one reward teach nothing: their tokens leave the mask),
        then :meth:`advantages`, plus the teacher's per-token reverse KL where ``teacher_kl_coef``
        weighs one in (:func:`~megarl.algorithms.distill.reverse_kl_advantages`)."""
        if cfg.dynamic_sampling:
            keep, _ = dynamic_sampling_mask(batch.episode_scores, batch.group_size)
            batch = replace(batch, mask=batch.mask * batch.to_rows(keep).to(batch.mask.dtype).unsqueeze(1))
        est = self.advantages(cfg, batch)
        if not self.needs_teacher(cfg):
            return est
        if batch.teacher_logprobs is None or batch.old_logprobs is None:
            raise ValueError(f"algorithm.teacher_kl_coef={cfg.teacher_kl_coef} needs the teacher's and the actor's "
                             "log-probs of the samples")
        term = reverse_kl_advantages(batch.old_logprobs, batch.teacher_logprobs, est.mask, cfg.teacher_kl_coef)
        return replace(est, advantages=est.advantages + term.to(est.advantages.dtype))

    def advantages(self, cfg: AlgorithmConfig, batch: ScoredBatch) -> Estimate:
        raise NotImplementedError

    @staticmethod
    def spread(seq_adv: torch.Tensor, batch: ScoredBatch, scale: torch.Tensor | float = 1.0) -> torch.Tensor:
        """A group estimator's episode advantages ``[B]`` onto its tokens: every response token gets
        its sequence's, or with per-turn rewards, each turn its reward-to-go against the same
        baseline (:func:`~megarl.algorithms.advantages.turn_advantages`; ``scale``: what the
        estimator divided the deviations by)."""
        if batch.turn_rewards is None:
            return broadcast(seq_adv, batch.mask)
        return turn_advantages(seq_adv, batch.scores, batch.turn_rewards, batch.mask, scale)

    # --- losses

    def policy_loss(self, cfg: AlgorithmConfig, mb: PolicyMicroBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The policy-gradient term and the micro-batch means named in ``metrics``: PPO's clipped
        surrogate (:func:`megarl.algorithms.losses.policy_loss`)."""
        return losses.policy_loss(mb.logprobs, mb.old_logprobs, mb.advantages, mb.mask, clip_low=cfg.clip_low,
                                  clip_high=cfg.clip_high, dual_clip=cfg.dual_clip, aggregation=cfg.aggregation,
                                  denom=mb.denom, norm_len=mb.norm_len)

    def loss(self, cfg: AlgorithmConfig, mb: PolicyMicroBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The policy's whole loss and its metrics (:meth:`loss_metrics`): the off-policy correction
        of the rollout/trainer mismatch, :meth:`policy_loss`, the KL term and the entropy bonus."""
        common = {"aggregation": cfg.aggregation, "denom": mb.denom, "norm_len": mb.norm_len}
        pg = mb
        if cfg.off_policy_correction != "none":  # the engine's policy mu sampled: weight or drop tokens by pi_old / mu
            if mb.rollout_logprobs is None:
                raise ValueError(f"algorithm.off_policy_correction={cfg.off_policy_correction!r} needs the rollout's "
                                 "log-probs in the batch")
            fix = off_policy_correction(cfg.off_policy_correction, mb.old_logprobs, mb.rollout_logprobs, mb.mask,
                                        cap=cfg.is_cap, low=cfg.is_low, high=cfg.is_high, floor=cfg.is_floor)
            advantages = mb.advantages if mb.advantages.dim() == 2 else mb.advantages[:, None]
            # dropped tokens add 0; the normaliser stays the batch's
            pg = replace(mb, advantages=advantages * fix.weights, mask=mb.mask * fix.keep)
        loss, metrics = self.policy_loss(cfg, pg)
        out = {"pg_loss": loss.detach()}
        if cfg.kl_coef > 0 and not cfg.kl_in_reward:
            if mb.ref_logprobs is None:
                raise ValueError(f"algorithm.kl_coef={cfg.kl_coef} needs the reference's log-probs in the batch")
            kl = losses.kl_loss(mb.logprobs, mb.ref_logprobs, mb.mask, estimator=cfg.kl_estimator, **common)
            loss = loss + cfg.kl_coef * kl
            out["kl_loss"] = kl.detach()
        if cfg.entropy_coef > 0:
            if mb.entropy is None:
                raise ValueError(f"algorithm.entropy_coef={cfg.entropy_coef} needs the policy's entropy in the batch")
            bonus = losses.entropy_loss(mb.entropy, mb.mask, **common)
            loss = loss + cfg.entropy_coef * bonus
            out["entropy"] = -bonus.detach()
        weight = share(mb.mask, mb.denom, cfg.aggregation)
        for metric in self.metrics:
            out[metric.name] = metrics[metric.name] * weight if metric.reduce == "mean" else metrics[metric.name]
        return loss, out

    def loss_metrics(self) -> tuple[Metric, ...]:
        """Every metric :meth:`loss` may emit."""
        return LOSS_METRICS + self.metrics

    def value_loss(self, cfg: AlgorithmConfig, mb: ValueMicroBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The critic's clipped regression loss and its metrics (``VALUE_METRICS``)."""
        loss, metrics = losses.value_loss(mb.values, mb.old_values, mb.returns, mb.mask, clip=cfg.value_clip,
                                          aggregation=cfg.aggregation, denom=mb.denom, norm_len=mb.norm_len)
        weight = share(mb.mask, mb.denom, cfg.aggregation)
        return loss, {"value_loss": loss.detach(), "value_clip_fraction": metrics["clip_fraction"] * weight}
