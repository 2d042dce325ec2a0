"""Held-out evaluation during training: the policy's accuracy on prompt sets it does not train on.

``Evaluator`` reads and tokenizes every ``eval.sets`` entry once, when the run is built (bad data
or an overlong prompt stops the run before the first step), and ``evaluate`` generates on the
run's vLLM engines and scores with the run's reward terms. Each set gives ``eval/<set>/<metric>``:

- ``accuracy``: the fraction of all samples that are correct. A sample is correct when its total
  reward is above ``eval.correct_threshold`` (0.5: a rule reward in [0, 1] scores a right answer
  1, a wrong one 0 and partial credit in between). With one sample per prompt this is the
  fraction of prompts answered right; with k it equals ``mean_at_k``.
- ``mean_at_k``: the mean over prompts of each prompt's fraction of correct samples.
- ``pass_at_k``: the mean over prompts of Chen et al.'s (2021) unbiased estimator
  1 - C(n - c, k) / C(n, k) with n = k samples drawn: 1 when any sample is correct.
- ``reward_mean``, ``response_length_mean`` (tokens) over all samples; ``prompts``.

A reward-model term is left out (the reward model is a Megatron group that the driver runs
on training batches only); the rule and remote terms keep their weights, and validation
refuses evaluation when there is no such term. The overlong penalty, a training signal, is
not applied. Sampling is the set's own (greedy by default; top-p and top-k off) with the
run's seed, the same at every evaluation: two evaluations of the same weights are identical,
and the step-to-step change is the weights', not the sampler's.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from megarl.config.schema import EvalConfig, EvalSetConfig, RunConfig
from megarl.data.prompts import PromptItem, prompt_dataset
from megarl.data.tokenize import tokenize_prompts
from megarl.rewards.base import RewardInput
from megarl.rewards.combined import RunReward
from megarl.rollout.episodes import Trajectory
from megarl.rollout.remote import episode_item, submit_episodes, submit_generation
from megarl.rollout.sampling import RolloutSample, SamplingConfig
from megarl.utils.abort import wait_all

METRICS = ("accuracy", "mean_at_k", "pass_at_k", "reward_mean", "response_length_mean", "tool_call_fraction",
           "prompts")


# --------------------------------------------------------------------------- metric arithmetic


def pass_at_k(n: int, c: int, k: int) -> float:
    """Chance that k of n samples, c of them correct, drawn without replacement hold a correct
    one: 1 - C(n - c, k) / C(n, k) (Chen et al. 2021's unbiased estimator of pass@k)."""
    if not 1 <= k <= n or not 0 <= c <= n:
        raise ValueError(f"pass_at_k needs 1 <= k <= n and 0 <= c <= n, got n={n}, c={c}, k={k}")
    if n - c < k:  # every draw of k holds a correct sample
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def set_metrics(name: str, rewards: Sequence[Sequence[float]], lengths: Sequence[Sequence[int]],
                threshold: float) -> dict[str, float]:
    """A set's metrics from each prompt's sample rewards and response lengths (prompts x k)."""
    if not rewards or any(len(r) != len(rewards[0]) or not r for r in rewards):
        raise ValueError(f"eval set {name!r}: every prompt needs the same number (>= 1) of samples")
    k = len(rewards[0])
    correct = [[value > threshold for value in prompt] for prompt in rewards]
    counts = [sum(prompt) for prompt in correct]
    samples = len(rewards) * k
    prefix = f"eval/{name}/"
    return {
        prefix + "accuracy": sum(counts) / samples,
        prefix + "mean_at_k": sum(c / k for c in counts) / len(counts),
        prefix + "pass_at_k": sum(pass_at_k(k, c, k) for c in counts) / len(counts),
        prefix + "reward_mean": sum(sum(prompt) for prompt in rewards) / samples,
        prefix + "response_length_mean": sum(sum(prompt) for prompt in lengths) / samples,
        prefix + "prompts": float(len(rewards)),
    }


def eval_due(cfg: EvalConfig, step: int, last_step: int) -> bool:
    """Whether to evaluate the weights after ``step`` updates (0: the initial weights)."""
    if not cfg.sets:
        return False
    if step == 0:
        return cfg.before_training
    return step == last_step or (cfg.every > 0 and step % cfg.every == 0)


# --------------------------------------------------------------------------- the evaluator


@dataclass
class EvalSet:
    """One set, ready to generate: its config, items (metadata for the rewards) and prompt ids."""

    cfg: EvalSetConfig
    items: list[PromptItem]
    prompts: list[list[int]]
    prompt_texts: list[str]  # what the rewards read as each sample's prompt


def load_eval_set(cfg: EvalSetConfig, tokenizer: Any, where: str) -> EvalSet:
    """Reads and tokenizes one set through the training data's loaders; errors name ``where``."""
    try:
        items = list(prompt_dataset(cfg.data_config()).items)
        prompts = tokenize_prompts(tokenizer, items, cfg.max_prompt_len, overlong="error").ids
    except (ValueError, OSError, ImportError) as e:
        raise ValueError(f"{where} ({cfg.name}): {' '.join(str(e).split())}") from e
    return EvalSet(cfg, items, prompts, [tokenizer.decode(p) for p in prompts])


class Evaluator:
    def __init__(self, cfg: RunConfig, engines: list, tokenizer: Any, reward: RunReward):
        self.cfg, self.engines, self.tokenizer = cfg, engines, tokenizer
        # the reward model scores training batches only; the rule and remote terms score evaluation
        self.reward = RunReward([t for t in reward.terms if t.kind != "model"], evaluation=True)
        self.sets = [load_eval_set(s, tokenizer, f"eval.sets[{i}]") for i, s in enumerate(cfg.eval.sets)]

    @property
    def active(self) -> bool:
        return bool(self.sets)

    def due(self, step: int) -> bool:
        """Whether ``step`` (0: before training) is one to evaluate at."""
        return eval_due(self.cfg.eval, step, self.cfg.trainer.steps)

    def evaluate(self, step: int, version: int | None = None) -> dict[str, float]:
        """Every set's metrics for the weights the engines hold now, after ``step`` updates.

        ``version``: the weight version the engines must hold (they refuse another, as for a
        rollout batch); None skips that check. Every set's prompts go to the engines at once,
        split over them as a rollout batch is (``submit_generation``), and vLLM batches them.
        """
        calls = [self._submit(s, version) for s in self.sets]
        flat = [ref for refs in calls for ref in refs]
        done = iter(wait_all(flat, self.cfg.trainer.step_timeout_s, f"evaluation at step {step}"))
        metrics: dict[str, float] = {}
        for s, refs in zip(self.sets, calls, strict=True):
            answers = [answer for _ in refs for answer in next(done)]
            metrics |= self._score_episodes(s, answers) if self.cfg.env is not None else self._score(s, answers)
        return metrics

    def _submit(self, s: EvalSet, version: int | None) -> list:
        max_tokens = self.cfg.rollout.max_tokens if s.cfg.max_tokens is None else s.cfg.max_tokens
        sampling = SamplingConfig(temperature=s.cfg.temperature, top_p=1.0, top_k=-1, max_tokens=max_tokens,
                                  n=s.cfg.samples, stop_token_ids=[self.tokenizer.eos_token_id], seed=self.cfg.seed,
                                  logprobs=False, weight_version=version)
        if self.cfg.env is not None:  # the set's prompts as episodes, with the run's environment and tools
            return submit_episodes(self.engines, [episode_item(item) for item in s.items], sampling, self.cfg)
        return submit_generation(self.engines, s.prompts, sampling)

    def _score_episodes(self, s: EvalSet, episodes: list[Trajectory]) -> dict[str, float]:
        """An env run's set: each episode's reward is the environment's (its final answer's score
        plus any shaping), its length the policy's own tokens; and how many episodes called a tool."""
        k = s.cfg.samples
        if len(episodes) != len(s.items) * k:
            raise RuntimeError(f"eval set {s.cfg.name!r}: the engines returned {len(episodes)} episodes "
                               f"for {len(s.items)} prompts x {k} samples")
        rewards = [[t.reward for t in episodes[i * k:(i + 1) * k]] for i in range(len(s.items))]
        lengths = [[sum(t.response_mask) for t in episodes[i * k:(i + 1) * k]] for i in range(len(s.items))]
        metrics = set_metrics(s.cfg.name, rewards, lengths, self.cfg.eval.correct_threshold)
        called = sum(t.info.get("tool_calls", 0) > 0 for t in episodes) / len(episodes)
        return metrics | {f"eval/{s.cfg.name}/tool_call_fraction": called}

    def _score(self, s: EvalSet, groups: list[list[RolloutSample]]) -> dict[str, float]:
        if len(groups) != len(s.items) or any(len(g) != s.cfg.samples for g in groups):
            raise RuntimeError(f"eval set {s.cfg.name!r}: the engines returned {len(groups)} prompts "
                               f"for {len(s.items)}, or not {s.cfg.samples} samples each")
        inputs = [RewardInput(prompt=text, metadata=item.metadata,
                              response=self.tokenizer.decode(sample.response_ids, skip_special_tokens=True))
                  for text, item, group in zip(s.prompt_texts, s.items, groups, strict=True) for sample in group]
        totals, _ = self.reward.score(inputs)
        k = s.cfg.samples
        values = totals.tolist()
        rewards = [values[i * k:(i + 1) * k] for i in range(len(groups))]
        lengths = [[len(sample.response_ids) for sample in group] for group in groups]
        return set_metrics(s.cfg.name, rewards, lengths, self.cfg.eval.correct_threshold)


# --------------------------------------------------------------------------- the end of a run


def final_table(history: list[dict[str, Any]]) -> str:
    """The eval metrics of the first and last evaluated steps side by side, one row per set and
    metric; empty when nothing was evaluated."""
    evaluated = [r for r in history if any(key.startswith("eval/") for key in r)]
    if not evaluated:
        return ""
    # one column when a single step was evaluated (no evaluation before training)
    shown = [evaluated[0], evaluated[-1]] if len(evaluated) > 1 else evaluated[:1]
    names = sorted({key.split("/")[1] for r in shown for key in r if key.startswith("eval/")})
    titles = [f"before (step {shown[0]['step']})", f"after (step {shown[-1]['step']})"] if len(shown) > 1 \
        else [f"step {shown[0]['step']}"]
    header = ("set", "metric", *titles)
    rows = [header]
    for name in names:
        for metric in METRICS:
            key = f"eval/{name}/{metric}"
            if any(key in r for r in shown):
                rows.append((name, metric, *(_cell(metric, r.get(key)) for r in shown)))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) if i < 2 else cell.rjust(w)
                       for i, (cell, w) in enumerate(zip(row, widths, strict=True))) for row in rows]
    return "\n".join(line.rstrip() for line in lines)


def _cell(metric: str, value: float | None) -> str:
    if value is None:
        return "-"
    if metric == "prompts":
        return str(int(value))
    return f"{value:.1f}" if metric == "response_length_mean" else f"{value:.4f}"
