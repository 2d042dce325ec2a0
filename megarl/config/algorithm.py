"""The ``algorithm`` section: which RL algorithm (``megarl.algorithms.registry``) and its settings.

Its enumerations and the defaults that depend on ``algorithm.name`` live here with it;
``megarl.config.schema`` re-exports them, so either import works.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

KLEstimator = Literal["k1", "k2", "k3"]
AggregationMode = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]
OffPolicyCorrection = Literal["none", "tis", "mis", "icepop", "token_mask", "seq_tis"]


# Settings whose default depends on ``algorithm.name``: a field left unset (None) takes the value
# of its algorithm's row, else of the "*" row, when the config is built (so set ``name`` then, in
# the recipe or an override, not by assigning it later). Each algorithm's module says why.
ALGORITHM_DEFAULTS: dict[str, dict[str, str | float | bool | None]] = {
    "*": {"clip_low": 0.2, "clip_high": 0.2, "aggregation": "token-mean", "norm_std": True, "teacher_kl_coef": 0.0},
    # Dr. GRPO (Liu et al. 2025): no division by the group's std, no per-sequence length normalisation
    "dr_grpo": {"aggregation": "seq-mean-token-sum", "norm_std": False},
    # GSPO (Zheng et al. 2025): a sequence ratio moves far less than a token's; loss averaged per sequence
    "gspo": {"clip_low": 3e-4, "clip_high": 4e-4, "aggregation": "seq-mean-token-mean"},
    # CISPO (MiniMax-M1): no lower bound on the importance weight (None), DAPO's clip-higher as its upper one
    "cispo": {"clip_low": None, "clip_high": 0.28},
    # SAPO (Gao et al. 2025): the paper's per-sequence mean of token losses
    "sapo": {"aggregation": "seq-mean-token-mean"},
    # On-policy distillation (megarl.algorithms.opd): the teacher's reverse KL is the whole advantage
    "opd": {"teacher_kl_coef": 1.0},
}


@dataclass
class AlgorithmConfig:
    name: str = "grpo"  # grpo | dr_grpo | rloo | reinforce_pp | ppo | gspo | cispo | sapo | clip_cov | kl_cov | opd
    kl_coef: float = 0.0
    kl_estimator: KLEstimator = "k3"
    kl_in_reward: bool = False  # else a KL term in the policy loss
    kl_target: float | None = None  # adapt kl_coef toward this KL per token (megarl.algorithms.kl_control); None: fixed
    kl_horizon: int = 10000  # kl_target: a step moves kl_coef by at most 0.2 x its samples / kl_horizon of itself
    # On-policy distillation (megarl.algorithms.opd): each sampled token's advantage gains
    # -teacher_kl_coef x (log pi(y_t) - log pi_teacher(y_t)), the teacher role's per-token reverse KL
    # (no discount, no baseline), on top of the algorithm's own (a task reward's). 0: no teacher; opd: 1,
    # the teacher alone. None: the algorithm's default.
    teacher_kl_coef: float | None = None
    # The policy ratio's clip range [1 - clip_low, 1 + clip_high]; clip_high > clip_low is DAPO's
    # clip-higher. None: the algorithm's default (ALGORITHM_DEFAULTS).
    clip_low: float | None = None
    clip_high: float | None = None
    dual_clip: float | None = None
    entropy_coef: float = 0.0
    aggregation: AggregationMode | None = None  # None: the algorithm's
    norm_std: bool | None = None  # group-relative advantages divided by the group's std; None: the algorithm's
    gamma: float = 1.0
    lam: float = 0.95
    value_clip: float | None = 0.2
    ppo_epochs: int = 1
    minibatches: int = 1  # optimizer steps per epoch
    dynamic_sampling: bool = False  # drop groups whose rewards are all equal
    overlong_buffer: int = 0  # DAPO soft overlong penalty over the last N tokens (0: off)
    overlong_penalty: float = 1.0
    # Rollout/trainer mismatch correction of the policy gradient (megarl.algorithms.off_policy):
    # tis: token weights min(r, is_cap); mis: drop sequences whose geometric-mean ratio leaves
    # [is_low, is_high]; icepop: token weights r inside that band, tokens outside it dropped (the
    # paper's M(r)); token_mask: the same band, kept tokens weighted 1; r = pi_old / mu.
    # seq_tis: each sequence's weights min(its geometric-mean r, is_cap) (megarl.algorithms.seq_tis).
    off_policy_correction: OffPolicyCorrection = "none"
    is_cap: float = 2.0
    is_floor: float | None = None  # tis, seq_tis: a lower bound on the weight too, clip(r, is_floor, is_cap)
    is_low: float = 0.5
    is_high: float = 2.0
    # sapo: the soft gate's temperatures for positive and negative advantages (megarl.algorithms.sapo)
    sapo_tau_pos: float = 1.0
    sapo_tau_neg: float = 1.05
    cov_fraction: float = 2e-4  # clip_cov, kl_cov: the valid tokens restrained (megarl.algorithms.entropy_cov)
    clip_cov_low: float = 1.0  # clip_cov: the covariance band its tokens are drawn from
    clip_cov_high: float = 5.0
    kl_cov_coef: float = 1.0  # kl_cov: the weight of |log r| on the highest-covariance tokens

    def __post_init__(self) -> None:
        for key, value in {**ALGORITHM_DEFAULTS["*"], **ALGORITHM_DEFAULTS.get(self.name, {})}.items():
            if getattr(self, key) is None:
                setattr(self, key, value)
