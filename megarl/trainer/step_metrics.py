"""What every step logs besides the updates' own metrics: rewards, lengths, KL, mismatch, timing."""

from __future__ import annotations

import torch

from megarl.algorithms import kl_estimate, masked_mean
from megarl.algorithms.base import Estimate
from megarl.algorithms.off_policy import mismatch_metrics, off_policy_correction
from megarl.config.schema import AlgorithmConfig
from megarl.rollout.episodes import episode_metrics
from megarl.rollout_driver.batch import Rollout, RolloutBatch
from megarl.workers.rank_results import TokenStats


def step_metrics(batch: RolloutBatch, scores: torch.Tensor, parts: dict[str, torch.Tensor], old: TokenStats,
                 ref: torch.Tensor | None, est: Estimate, algo: AlgorithmConfig) -> dict[str, float]:
    """What every step logs besides the updates' own metrics; ``old`` holds the actor's
    log-probs and entropy before the update, ``ref`` the reference's log-probs. The
    mismatch metrics are those of ``algo``'s off-policy correction, as the ranks applied it."""
    mask = batch.mask
    diff = (old.logprobs - batch.rollout_logprobs).abs()
    rewards = batch.per_episode(scores)  # one per episode where an episode trains as several rows
    groups = rewards.view(-1, batch.group_size)
    out = {
        "reward/mean": float(rewards.mean()), "reward/std": float(rewards.std()) if rewards.numel() > 1 else 0.0,
        "response/length_mean": float(batch.response_lens.float().mean()),
        "response/truncated_fraction": sum(r == "length" for r in batch.finish_reasons) / batch.size,
        "entropy/mean": float(masked_mean(old.entropy, mask)),
        "mismatch/max_abs_logprob": float((diff * mask).max()),
        "mismatch/token_mult_prob_error": float(masked_mean(torch.exp(diff), mask)),
        "groups/mixed_fraction": float((groups.max(1).values != groups.min(1).values).float().mean()),
    }
    if ref is not None:  # k1 over the responses the update learnt from
        out["kl/mean"] = float(masked_mean(kl_estimate(old.logprobs, ref, estimator="k1") * est.mask, mask))
    for name, values in parts.items():
        out[name] = float(batch.per_episode(values).mean())
    correction = off_policy_correction(algo.off_policy_correction, old.logprobs, batch.rollout_logprobs, mask,
                                       cap=algo.is_cap, low=algo.is_low, high=algo.is_high)
    return out | mismatch_metrics(old.logprobs, batch.rollout_logprobs, mask, correction)


def timing(phase_times: dict[str, float], batch: RolloutBatch, step_seconds: float,
           offloaded_bytes: int | None, generation_seconds: float, engines: int) -> dict[str, float]:
    """Seconds per phase and for the step, tokens per second, how busy each side was;
    colocated, the MiB the roles moved off the device (``offloaded_bytes``; None when
    disaggregated). ``generation_seconds``: the engines' time in generate() during the step,
    summed over ``engines`` (ahead of training, part of it generates later steps' batches)."""
    generated = float(batch.mask.sum())  # the policy's tokens (an episode's observations are not generated)
    out = {f"time/{name}_s": seconds for name, seconds in phase_times.items()}
    out["time/step_s"] = step_seconds
    out["throughput/tokens_per_s"] = generated / step_seconds
    out["throughput/generation_tokens_per_s"] = generated / max(phase_times.get("rollout", 0.0), 1e-9)
    out["busy/rollout_fraction"] = generation_seconds / (engines * step_seconds)
    # the actor's own work; the other roles' phases are as long as they block the step
    out["busy/actor_fraction"] = sum(phase_times.get(p, 0.0) for p in ACTOR_PHASES) / step_seconds
    if offloaded_bytes is not None:
        out["memory/offloaded_mib"] = offloaded_bytes / 2**20
    return out


ACTOR_PHASES = ("actor_logprobs", "actor_update", "weight_sync")


def rollout_metrics(rollout: Rollout, step: int) -> dict:
    """Where the step's batch came from: its weight version, how stale, which prompts (their
    dataset ids, so a resumed run can be checked against the straight one)."""
    out = {"rollout/weight_version": rollout.version, "rollout/staleness": step - 1 - rollout.version,
           "data/prompt_ids": list(rollout.prompt_ids)}
    if rollout.token_versions is not None:  # partial rollouts: a sample's tokens may span versions
        tokens = [v for vs in rollout.token_versions for v in vs]
        out["rollout/token_staleness_mean"] = sum(step - 1 - v for v in tokens) / max(1, len(tokens))
        out["rollout/spanning_fraction"] = (sum(len(set(vs)) > 1 for vs in rollout.token_versions)
                                            / max(1, len(rollout.token_versions)))
    if rollout.episodes is not None:
        out |= episode_metrics(rollout.episodes)
    if rollout.interrupted_episodes is not None:  # episodes under the opportunistic schedule
        out["rollout/interrupted_episodes"] = rollout.interrupted_episodes
    if rollout.lost_episodes:  # an engine's fault cut them: they started over on another engine
        out["rollout/lost_episodes"] = rollout.lost_episodes
    if rollout.group_arrival_s is not None:  # rollout.granularity=group
        out["time/rollout_first_group_s"], out["time/rollout_last_group_s"] = rollout.group_arrival_s
    return out
