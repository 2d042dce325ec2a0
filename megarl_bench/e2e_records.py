"""What each side of ``megarl bench e2e`` reports: its steps and its overhead."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StepRecord:
    tokens: int  # response tokens generated in the step (EOS included, padding not)
    seconds: float  # the step's wall time
    reward: float  # mean reward of the step's samples


@dataclass
class SystemResult:
    system: str
    steps: list[StepRecord]
    overhead_s: float  # wall time outside the steps: start-up, final checkpoint, shutdown
    samples_per_step: int  # responses generated per step (prompts per step x group size)
    notes: list[str] = field(default_factory=list)
    # to the first step's start, imports included: TRL from its fresh process's first line; megarl
    # from train()'s call (time/startup_s) plus its driver's imports timed in a fresh interpreter;
    # megarl's held-out evaluation before training not included (TRL has none)
    startup_s: float | None = None
