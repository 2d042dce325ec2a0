"""The run's reward: weighted terms from the config, scored on decoded samples. The one place
where terms are combined: the driver's batched scoring, the held-out evaluation and the
environments' final answers all sum through it, so ``eval_only`` means the same everywhere.

Rule-based and remote terms score text; a ``model`` term is the reward model's
score (a Megatron inference group), computed by the driver and passed in.
Every term is also returned on its own, so each can be logged.
"""

from __future__ import annotations

import torch

from megarl.config.schema import RewardTermConfig
from megarl.rewards.base import RewardInput, check_rewards
from megarl.rewards.terms import build_term


class RunReward:
    def __init__(self, terms: list[RewardTermConfig], evaluation: bool = False):
        self.terms = terms
        self.evaluation = evaluation  # eval_only terms count (held-out evaluation)
        self.functions = {i: build_term(t) for i, t in enumerate(terms) if t.kind != "model"}

    @property
    def needs_model(self) -> bool:
        return any(t.kind == "model" for t in self.terms)

    @property
    def needs_main_thread(self) -> bool:
        """math-verify's parse timeouts are signals, which only a process's main thread receives:
        such a term scores in the driver, not in the rollout service's background thread."""
        return any(t.kind == "math_verify" for t in self.terms)

    def score(self, inputs: list[RewardInput], model_scores: torch.Tensor | None = None, text_only: bool = False
              ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Weighted sum [B] and each term's unweighted values, named ``reward/<kind>``; an
        ``eval_only`` term is in the sum only when evaluating. ``text_only``: without the
        ``model`` term (scored where no reward-model group is, e.g. an environment's answer)."""
        total = torch.zeros(len(inputs))
        parts: dict[str, torch.Tensor] = {}
        for i, term in enumerate(self.terms):
            if term.kind == "model":
                if text_only:
                    continue
                if model_scores is None:
                    raise ValueError(f"rewards[{i}] (model): the reward model's scores were not passed")
                values = model_scores
            else:
                # each term checked on its own: a bad one is named, not hidden in the sum
                checked = check_rewards(self.functions[i](inputs), len(inputs), f"rewards[{i}] ({term.kind})")
                values = torch.tensor(checked, dtype=torch.float32)
            kind = term.kind.rpartition(":")[2]  # a recipe's own scorer by its name
            name = f"reward/{kind}" if f"reward/{kind}" not in parts else f"reward/{kind}{i}"
            parts[name] = values
            if self.evaluation or not term.eval_only:
                total += term.weight * values
        return total, parts

    def __call__(self, samples: list[RewardInput]) -> list[float]:
        """As a ``RewardFn``: the weighted sum of the text terms (how environments score answers)."""
        total, _ = self.score(samples, text_only=True)
        return total.tolist()
