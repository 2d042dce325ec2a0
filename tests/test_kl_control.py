"""The adaptive KL controller (Ziegler et al. 2019) against coefficients worked out by hand.

Start beta = 0.1, target 0.02 nats per token, horizon 10000 samples, steps of 64 samples:

    KL 0.03   error clip(0.03 / 0.02 - 1 = 0.5) = 0.2   beta = 0.1 * (1 + 0.2 * 64 / 10000)
    KL 0.019  error -0.05 (inside the clip)            beta = beta * (1 - 0.05 * 64 / 10000)
    KL 0.0    error clip(-1) = -0.2                    beta = beta * (1 - 0.2 * 64 / 10000)
    KL 0.02   error 0                                  beta unchanged
"""

from __future__ import annotations

import math

import pytest

from megarl.algorithms.kl_control import AdaptiveKLController, FixedKLController, kl_controller
from megarl.algorithms.registry import algorithm_errors
from megarl.config.loader import load_config
from megarl.config.schema import AlgorithmConfig, RoleConfig, RunConfig
from megarl.validation.ranges import range_errors


def test_the_coefficient_by_hand():
    ctl = AdaptiveKLController(0.1, target=0.02, horizon=10000)
    expected = 0.1
    for kl, error in ((0.03, 0.2), (0.019, -0.05), (0.0, -0.2), (0.02, 0.0)):
        expected *= 1 + error * 64 / 10000
        assert ctl.update(kl, n_steps=64) == pytest.approx(expected, rel=1e-15)
        assert ctl.value == pytest.approx(expected, rel=1e-15)


def test_above_the_target_it_grows_below_it_shrinks():
    up, down = AdaptiveKLController(1.0, 0.1, 100), AdaptiveKLController(1.0, 0.1, 100)
    for _ in range(50):  # at most +-20% of n / horizon per step: (1 +- 0.2 * 10 / 100) ** 50
        up.update(1.0, 10)
        down.update(0.01, 10)
    assert up.value == pytest.approx(1.02 ** 50) and down.value == pytest.approx(0.98 ** 50)


def test_fixed_and_adaptive_by_the_config():
    fixed = kl_controller(AlgorithmConfig(kl_coef=0.05))
    assert type(fixed) is FixedKLController and fixed.update(10.0, 64) == 0.05
    ctl = kl_controller(AlgorithmConfig(kl_coef=0.05, kl_target=0.01, kl_horizon=500))
    assert isinstance(ctl, AdaptiveKLController) and (ctl.value, ctl.target, ctl.horizon) == (0.05, 0.01, 500)
    assert AlgorithmConfig().kl_target is None and AlgorithmConfig().kl_horizon == 10000


def test_the_state_survives_a_checkpoint():
    ctl = AdaptiveKLController(0.1, 0.02, 10000)
    ctl.update(0.05, 256)
    again = AdaptiveKLController(0.1, 0.02, 10000)
    again.load_state_dict(ctl.state_dict())
    assert again.value == ctl.value != 0.1


def test_a_non_finite_kl_is_refused_not_absorbed():
    ctl = AdaptiveKLController(0.1, 0.02, 10000)
    with pytest.raises(ValueError, match="the step's KL is nan"):
        ctl.update(math.nan, 64)
    assert ctl.value == 0.1
    for bad in ((0.0, 0.02, 10), (0.1, 0.0, 10), (0.1, 0.02, 0)):
        with pytest.raises(ValueError):
            AdaptiveKLController(*bad)


@pytest.mark.parametrize("override,line", [
    ("algorithm.kl_target=0", "algorithm.kl_target=0.0 must be > 0"),
    ("algorithm.kl_horizon=0", "algorithm.kl_horizon=0 must be >= 1"),
])
def test_bad_settings_are_refused_in_one_line(override, line):
    cfg = load_config(RunConfig, overrides=["algorithm.kl_coef=0.01", override])
    assert [e for e in range_errors(cfg) if "kl_" in e] == [line]


def test_a_target_needs_a_coefficient_to_scale():
    run = RunConfig(reference=RoleConfig(), algorithm=AlgorithmConfig(kl_coef=0.01, kl_target=0.05))
    assert algorithm_errors(run) == [] and not [e for e in range_errors(run) if "kl_" in e]
    run.algorithm = AlgorithmConfig(kl_coef=0.0, kl_target=0.05)
    assert algorithm_errors(run) == ["algorithm.kl_target=0.05 adapts kl_coef by scaling it, from its first value: "
                                     "kl_coef=0.0 would stay there; set kl_coef > 0"]
