"""A lower bound for truncated importance sampling: ``tis`` weights clip(r, is_floor, is_cap).

Log ratios log r = log pi_old - log mu (float64), padding with garbage:

    row 0: -1, 0.3, 1   ->  r = e^-1 (0.368), e^0.3 (1.350), e (2.718)
    row 1: -0.2         ->  r = e^-0.2 (0.819)

With cap 2 and floor 0.5 the weights are 0.5, e^0.3, 2 | 0.819; without a floor (the default)
token 0 keeps e^-1, as before.
"""

from __future__ import annotations

import math

import pytest
import torch

from megarl.algorithms import get_algorithm
from megarl.algorithms.base import PolicyMicroBatch
from megarl.algorithms.off_policy import off_policy_correction
from megarl.algorithms.registry import algorithm_errors
from megarl.config.loader import load_config
from megarl.config.schema import AlgorithmConfig, RunConfig
from megarl.validation.ranges import range_errors

F64 = torch.float64
MASK = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]], dtype=F64)
OLD = torch.tensor([[-2.0, -1.0, -0.5, 50.0], [-0.7, 9.0, 9.0, 9.0]], dtype=F64)
MU = torch.tensor([[-1.0, -1.3, -1.5, -80.0], [-0.5, 0.0, 0.0, 0.0]], dtype=F64)
FLOORED = [[0.5, math.exp(0.3), 2.0, 0.0], [math.exp(-0.2), 0.0, 0.0, 0.0]]


def close(actual: torch.Tensor, expected, atol: float = 1e-12) -> None:
    torch.testing.assert_close(actual.detach().to(F64), torch.as_tensor(expected, dtype=F64), atol=atol, rtol=0)


def test_tis_weights_between_floor_and_cap():
    fix = off_policy_correction("tis", OLD, MU, MASK, cap=2.0, floor=0.5)
    close(fix.weights, FLOORED)
    close(fix.keep, MASK)  # a floor drops nothing


def test_no_floor_is_todays_tis():
    fix = off_policy_correction("tis", OLD, MU, MASK, cap=2.0)
    close(fix.weights, [[math.exp(-1.0), math.exp(0.3), 2.0, 0.0], [math.exp(-0.2), 0.0, 0.0, 0.0]])
    assert AlgorithmConfig().is_floor is None


def test_the_floor_reaches_the_policy_gradient():
    # on-policy (ratio 1), token-mean over 4 tokens, advantages 1 | -1: l_t = -w_t * A_t, grad -w_t * A_t / 4
    cfg = AlgorithmConfig(name="grpo", off_policy_correction="tis", is_cap=2.0, is_floor=0.5)
    lp = OLD.clone().requires_grad_()
    mb = PolicyMicroBatch(logprobs=lp, old_logprobs=OLD, advantages=torch.tensor([1.0, -1.0], dtype=F64), mask=MASK,
                          denom=4.0, rollout_logprobs=MU)
    loss, _ = get_algorithm("grpo").loss(cfg, mb)
    loss.backward()
    w = FLOORED
    close(loss, (-(w[0][0] + w[0][1] + w[0][2]) + w[1][0]) / 4)
    close(lp.grad, [[-w[0][0] / 4, -w[0][1] / 4, -w[0][2] / 4, 0.0], [w[1][0] / 4, 0.0, 0.0, 0.0]])


@pytest.mark.parametrize("value", ["0", "1.5", "-0.1"])
def test_a_floor_outside_0_1_is_refused_in_one_line(value):
    cfg = load_config(RunConfig, overrides=["algorithm.off_policy_correction=tis", f"algorithm.is_floor={value}"])
    assert [e for e in range_errors(cfg) if "is_floor" in e] == [f"algorithm.is_floor={float(value)} must be in (0, 1]"]
    with pytest.raises(ValueError, match="0 < floor <= 1"):
        off_policy_correction("tis", OLD, MU, MASK, floor=float(value))


def test_a_floor_needs_a_truncated_weight():
    ok = load_config(RunConfig, overrides=["algorithm.off_policy_correction=tis", "algorithm.is_floor=0.5"])
    assert algorithm_errors(ok) == [] and not [e for e in range_errors(ok) if "is_floor" in e]
    cfg = load_config(RunConfig, overrides=["algorithm.off_policy_correction=mis", "algorithm.is_floor=0.5"])
    assert algorithm_errors(cfg) == ["algorithm.is_floor=0.5 bounds truncated importance weights from below; "
                                     "off_policy_correction='mis' has none (use tis or seq_tis)"]
