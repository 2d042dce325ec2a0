"""The KL coefficient over a run: fixed (``algorithm.kl_coef``), or adapted each step toward a
target KL (Ziegler et al. 2019, "Fine-Tuning Language Models from Human Preferences", Sec. 2.2).

The adaptive controller is a proportional controller on the log of the coefficient::

    e_t       = clip(KL_t / KL_target - 1, -0.2, 0.2)
    beta_t+1  = beta_t * (1 + e_t * n_t / horizon)

with ``KL_t`` the step's measured KL between the actor and the reference, ``n_t`` the samples
(sequences) of the step and ``horizon`` the samples over which the coefficient may move by about
``e^0.2`` (the error is clipped to +-20%, so one step changes beta by at most ``0.2 n / horizon``).
The paper writes the gain as ``beta (1 + K_beta e_t)``; its code (openai/lm-human-preferences)
and verl's ``AdaptiveKLController`` set ``K_beta = n_t / horizon`` with a horizon of 10000
samples, the default here (``algorithm.kl_horizon``). ``algorithm.kl_target`` (None: a fixed
coefficient) is in the units of the KL the driver measures: megarl's ``kl/mean``, the k1 estimate
per response token (verl's convention; Ziegler et al.'s KL is per sample, summed over its
tokens). The coefficient starts at ``algorithm.kl_coef`` (> 0: a multiplicative controller
started at 0 stays there).

Pure and host-side: the run keeps one controller (``megarl.trainer.run.Run.kl_control``), each
step's algorithm settings take its ``value`` as ``kl_coef`` (``megarl.trainer.loop``), the step's
``kl/mean`` and number of sequences update it (logged as ``kl/coef``), and its ``state_dict`` is
in every checkpoint, so a resumed run continues the same schedule.
"""

from __future__ import annotations

import math

from megarl.config.schema import AlgorithmConfig

MAX_PROPORTIONAL_ERROR = 0.2


class FixedKLController:
    """``kl_coef`` as given, every step."""

    def __init__(self, kl_coef: float):
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> float:
        return self.value

    def state_dict(self) -> dict[str, float]:
        return {"kl_coef": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["kl_coef"])


class AdaptiveKLController(FixedKLController):
    """Ziegler et al.'s controller: the coefficient grows while the measured KL is above the target
    and shrinks while it is below, by at most ``0.2 * n_steps / horizon`` of itself per update."""

    def __init__(self, kl_coef: float, target: float, horizon: int):
        if not (math.isfinite(kl_coef) and kl_coef > 0):
            raise ValueError(f"an adaptive KL coefficient starts > 0 (it is scaled), got kl_coef={kl_coef}")
        if not (math.isfinite(target) and target > 0):
            raise ValueError(f"the KL target must be > 0, got {target}")
        if not horizon >= 1:
            raise ValueError(f"the horizon must be >= 1 sample, got {horizon}")
        super().__init__(kl_coef)
        self.target = float(target)
        self.horizon = int(horizon)

    def update(self, current_kl: float, n_steps: int) -> float:
        """The coefficient after a step of ``n_steps`` samples whose KL was ``current_kl``."""
        if not math.isfinite(current_kl):
            raise ValueError(f"the step's KL is {current_kl}: the KL controller cannot adapt to it")
        error = min(max(current_kl / self.target - 1.0, -MAX_PROPORTIONAL_ERROR), MAX_PROPORTIONAL_ERROR)
        self.value *= 1.0 + error * n_steps / self.horizon
        return self.value


def kl_controller(cfg: AlgorithmConfig) -> FixedKLController:
    """The run's controller: adaptive when ``cfg.kl_target`` is set, else fixed at ``cfg.kl_coef``."""
    if cfg.kl_target is None:
        return FixedKLController(cfg.kl_coef)
    return AdaptiveKLController(cfg.kl_coef, cfg.kl_target, cfg.kl_horizon)
