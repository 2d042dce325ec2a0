"""On-policy distillation: the student (the actor) samples, a teacher role scores each sampled token.

The teacher is a frozen model of the actor's tokenizer (``teacher`` in the recipe, perhaps a larger
model). Each sampled token y_t gets the per-token reverse KL of the student to the teacher as its
advantage (Thinking Machines' "On-Policy Distillation", 2025; the reverse-KL objective of GKD,
Agarwal et al. 2024)::

    A_t = -c * (log pi(y_t | y_<t) - log pi_teacher(y_t | y_<t))

with ``c = algorithm.teacher_kl_coef``: no discount (a token is credited with its own term only, not
the rest of the sequence's) and no baseline. Its expectation over the student's own samples is
``-c * KL(pi || pi_teacher)`` at each prefix, so PPO's surrogate with it follows the gradient of the
student's reverse KL: mode-seeking, and taught on the student's own states rather than the teacher's.

``algorithm.name: opd`` learns from the teacher alone (the task reward is still scored and logged, so
held-out accuracy and reward/mean say what the student learnt). Any other algorithm with
``teacher_kl_coef > 0`` adds the same term to its own advantages: a task reward mixed with the
teacher (:meth:`~megarl.algorithms.base.Algorithm.estimate` adds it). In multi-turn episodes only
the policy's tokens (the response mask) are scored; an environment's inserted observations are not.
"""

from __future__ import annotations

import torch

from megarl.algorithms.base import Algorithm, Estimate, ScoredBatch
from megarl.config.schema import AlgorithmConfig


class OPD(Algorithm):
    """The teacher's per-token reverse KL as the only advantage (``teacher_kl_coef``, default 1)."""

    name = "opd"

    def errors(self, cfg: AlgorithmConfig) -> list[str]:
        errors = []
        if not cfg.teacher_kl_coef:
            errors.append(f"algorithm.teacher_kl_coef={cfg.teacher_kl_coef}: opd learns from the teacher alone, "
                          "its weight must be > 0")
        if cfg.dynamic_sampling:
            errors.append("algorithm.dynamic_sampling drops groups whose task rewards are equal; opd learns from "
                          "the teacher on every sample, whatever its reward")
        return errors

    def advantages(self, cfg: AlgorithmConfig, batch: ScoredBatch) -> Estimate:
        # the task reward teaches nothing here: Algorithm.estimate adds the teacher's term to these zeros
        return Estimate(torch.zeros(batch.mask.shape, dtype=torch.float32), batch.mask)
