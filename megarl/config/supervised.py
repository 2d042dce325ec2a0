"""Typed configs of the supervised stages: ``megarl sft``, ``megarl rm`` and ``megarl dpo``.

One recipe shape for the three: the trained ``model`` (a role: source, layout, optimizer,
micro-batches), the ``reference`` for DPO (its own layout; default: the model's source at the
model's layout), ``data`` (a JSONL file or a reasoning-gym task, see ``megarl.data.supervised``)
and ``trainer`` (steps, evaluation, checkpoints). ``stage`` is set by the command.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal, get_args

from megarl.config.schema import Resume, RoleConfig

Stage = Literal["sft", "rm", "dpo"]
DpoLoss = Literal["sigmoid", "ipo", "kto"]
STAGES: tuple[str, ...] = get_args(Stage)
DPO_LOSSES: tuple[str, ...] = get_args(DpoLoss)


@dataclass
class DpoConfig:
    beta: float = 0.1
    loss_type: DpoLoss = "sigmoid"  # kto: unpaired (megarl.algorithms.kto)
    label_smoothing: float = 0.0  # conservative DPO (sigmoid only): the chance a pair's label is wrong
    # The reference's log-probs of every pair computed once at the start, after which the reference
    # group stops (its memory and processes freed); false: the reference scores each step's batch.
    precompute_reference: bool = False
    # kto: the weights of desirable and undesirable examples' losses (KTO's lambda_D, lambda_U;
    # the paper keeps w_d * n_desirable / (w_u * n_undesirable) within [1, 4/3])
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0
    # RPO: the weight of the chosen answer's per-token NLL added to each pair's loss (megarl.algorithms.rpo);
    # 0: plain DPO. sigmoid and ipo only
    rpo_alpha: float = 0.0

    def problems(self, prefix: str = "dpo") -> list[str]:
        out = []
        if isinstance(self.beta, bool) or not (isinstance(self.beta, int | float) and math.isfinite(self.beta)
                                               and self.beta > 0):
            out.append(f"{prefix}.beta must be a positive number, got {self.beta!r}")
        if not (isinstance(self.label_smoothing, int | float) and 0.0 <= self.label_smoothing < 0.5):
            out.append(f"{prefix}.label_smoothing must be in [0, 0.5), got {self.label_smoothing!r}")
        elif self.label_smoothing and self.loss_type != "sigmoid":
            out.append(f"{prefix}.label_smoothing applies to loss_type sigmoid only")
        if self.loss_type == "kto" and self.precompute_reference:
            out.append(f"{prefix}.precompute_reference does not apply to loss_type kto: its KL rows (each prompt "
                       "with another pair's answer) change with every batch, so the reference scores each step")
        alpha = self.rpo_alpha
        if isinstance(alpha, bool) or not (isinstance(alpha, int | float) and math.isfinite(alpha) and alpha >= 0):
            out.append(f"{prefix}.rpo_alpha must be a number >= 0, got {alpha!r}")
        elif alpha and self.loss_type == "kto":
            out.append(f"{prefix}.rpo_alpha applies to pairs (loss_type sigmoid or ipo): kto's answers have no "
                       "chosen one to add the NLL of")
        for name in ("desirable_weight", "undesirable_weight"):
            value = getattr(self, name)
            if isinstance(value, bool) or not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                out.append(f"{prefix}.{name} must be a positive number, got {value!r}")
        return out


@dataclass
class SupervisedDataConfig:
    # a JSONL file of records, or "reasoning_gym:<task>" (records generated from the task)
    train: str = "reasoning_gym:basic_arithmetic"
    # held-out records, same forms; empty: the last eval_size records of train are held out
    eval: str = ""
    eval_size: int = 64
    max_len: int = 512  # tokens per sequence; a longer record is refused, not cut
    batch_size: int = 16  # sequences (sft) or pairs (rm, dpo) per optimizer step
    seed: int = 0  # the order of examples in each epoch
    # reasoning-gym sources only
    size: int = 512
    task_config: dict = field(default_factory=dict)
    instruction: str = ""  # template with {question}; empty: the package default


@dataclass
class SupervisedTrainerConfig:
    steps: int = 0  # optimizer steps; 0: epochs x (train examples // batch_size)
    epochs: int = 1
    eval_every: int = 0  # steps between held-out evaluations (0: before the first and after the last)
    checkpoint_every: int = 0  # steps between checkpoints (0: after the last only)
    resume: Resume = "auto"  # auto: continue from output_dir's latest checkpoint; never
    tensorboard: bool = True
    step_timeout_s: float = 1800.0
    collective_timeout_s: float = 600.0


@dataclass
class SupervisedConfig:
    stage: str = ""  # sft | rm | dpo: the command sets it (a recipe that names one refuses the others)
    name: str = "megarl-supervised"
    output_dir: str = "runs/supervised"
    seed: int = 1234
    model: RoleConfig = field(default_factory=RoleConfig)
    reference: RoleConfig | None = None  # dpo: None is the model's source at the model's layout
    data: SupervisedDataConfig = field(default_factory=SupervisedDataConfig)
    trainer: SupervisedTrainerConfig = field(default_factory=SupervisedTrainerConfig)
    dpo: DpoConfig = field(default_factory=DpoConfig)
