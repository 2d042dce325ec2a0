"""SAPO against numbers worked out by hand: the soft gate's loss and gradient, token by token.

Two sequences (float64), 3 and 1 valid tokens, padding with garbage (NaN advantages, huge
log-probs). Log ratios log r = lp - old:

    row 0: 0, 0.5, -0.3   advantages 1, 1, -2   temperatures 1, 1, 1.05 (tau_neg for A < 0)
    row 1: 0.2            advantage -0.5        temperature 1.05

Per token ``l = -(4 / tau) * sigmoid(tau * (r - 1)) * A`` and ``dl / dlp = -A * 4 s (1 - s) * r``
with ``s = sigmoid(tau * (r - 1))``; "seq-mean-token-mean" over the 2 sequences: row 0's tokens
weigh 1 / 6, row 1's 1 / 2. At r = 1 the gate's weight 4 s (1 - s) is 1/4 * 4 = 1: token 0 gets
the plain policy gradient -A / 6.
"""

from __future__ import annotations

import math

import pytest
import torch

from megarl.algorithms import get_algorithm, policy_loss
from megarl.algorithms.base import PolicyMicroBatch
from megarl.config.loader import load_config
from megarl.config.schema import AlgorithmConfig, RunConfig
from megarl.validation.ranges import range_errors

F64 = torch.float64
NAN = float("nan")
MASK = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]], dtype=F64)
LP = torch.tensor([[-1.0, -2.0, -0.5, 40.0], [-0.1, 60.0, 60.0, 60.0]], dtype=F64)
OLD = torch.tensor([[-1.0, -2.5, -0.2, 0.0], [-0.3, 0.0, 0.0, 0.0]], dtype=F64)
A = torch.tensor([[1.0, 1.0, -2.0, NAN], [-0.5, NAN, NAN, NAN]], dtype=F64)
# (log r, A, tau) of the valid tokens, row by row
TOKENS = [[(0.0, 1.0, 1.0), (0.5, 1.0, 1.0), (-0.3, -2.0, 1.05)], [(0.2, -0.5, 1.05)]]


def sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def by_hand(log_r: float, adv: float, tau: float) -> tuple[float, float]:
    """(loss, d loss / d log pi) of one token."""
    r = math.exp(log_r)
    s = sigmoid(tau * (r - 1.0))
    return -4.0 / tau * s * adv, -adv * 4.0 * s * (1.0 - s) * r


def close(actual: torch.Tensor, expected, atol: float = 1e-12) -> None:
    torch.testing.assert_close(actual.detach().to(F64), torch.as_tensor(expected, dtype=F64), atol=atol, rtol=0)


def run(cfg: AlgorithmConfig, advantages: torch.Tensor = A, denom: float = 2.0):
    lp = LP.clone().requires_grad_()
    mb = PolicyMicroBatch(logprobs=lp, old_logprobs=OLD, advantages=advantages, mask=MASK, denom=denom)
    loss, metrics = get_algorithm("sapo").policy_loss(cfg, mb)
    loss.backward()
    return loss, lp.grad, metrics


def test_sapo_defaults():
    cfg = AlgorithmConfig(name="sapo")
    assert (cfg.sapo_tau_pos, cfg.sapo_tau_neg, cfg.aggregation) == (1.0, 1.05, "seq-mean-token-mean")


def test_sequence_mean_loss_and_gradient_by_hand():
    loss, grad, metrics = run(AlgorithmConfig(name="sapo"))
    row0 = [by_hand(*t) for t in TOKENS[0]]
    row1 = [by_hand(*t) for t in TOKENS[1]]
    close(loss, (sum(v for v, _ in row0) / 3 + row1[0][0]) / 2)
    close(grad, [[g / 6 for _, g in row0] + [0.0], [row1[0][1] / 2, 0.0, 0.0, 0.0]])
    close(grad[0, 0], -1 / 6)  # on-policy token: the plain policy gradient -A / 6
    # the gate's weight 4 s (1 - s), averaged as the loss: row 0's tokens' mean, then over sequences
    weights = [[4 * sigmoid(tau * (math.exp(lr) - 1)) * (1 - sigmoid(tau * (math.exp(lr) - 1))) for lr, _, tau in row]
               for row in TOKENS]
    close(metrics["gate_weight"], (sum(weights[0]) / 3 + weights[1][0]) / 2)
    close(metrics["ratio_mean"], ((1 + math.exp(0.5) + math.exp(-0.3)) / 3 + math.exp(0.2)) / 2)


def test_token_mean_and_other_temperatures():
    cfg = AlgorithmConfig(name="sapo", aggregation="token-mean", sapo_tau_pos=2.0, sapo_tau_neg=3.0)
    loss, grad, _ = run(cfg, denom=4.0)
    tokens = [(lr, a, 2.0 if a > 0 else 3.0) for row in TOKENS for lr, a, _ in row]
    hand = [by_hand(*t) for t in tokens]
    close(loss, sum(v for v, _ in hand) / 4)
    close(grad[MASK.bool()], [g / 4 for _, g in hand])


def test_the_gate_fades_where_ppo_cuts():
    # A > 0 and r = e^0.5 = 1.65, beyond PPO's 1.2: PPO gives token 1 no gradient, SAPO a damped one;
    # at r = e^2 its weight w * r is below 0.06 of the on-policy gradient, and never exactly 0
    lp = LP.clone().requires_grad_()
    ppo, _ = policy_loss(lp, OLD, torch.nan_to_num(A), MASK, clip_low=0.2, clip_high=0.2, denom=4.0)
    ppo.backward()
    _, grad, _ = run(AlgorithmConfig(name="sapo", aggregation="token-mean"), denom=4.0)
    assert lp.grad[0, 1] == 0.0 and grad[0, 1] < 0.0
    far = by_hand(2.0, 1.0, 1.0)[1]
    assert -0.06 < far < 0.0


def test_an_exploding_ratio_gives_a_finite_gradient():
    lp = torch.tensor([[500.0, -1.0]], dtype=F64, requires_grad=True)
    mb = PolicyMicroBatch(logprobs=lp, old_logprobs=torch.tensor([[-1.0, -1.0]], dtype=F64),
                          advantages=torch.tensor([-1.0], dtype=F64), mask=torch.ones(1, 2, dtype=F64), denom=1.0)
    loss, _ = get_algorithm("sapo").policy_loss(AlgorithmConfig(name="sapo"), mb)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(lp.grad).all()


def test_sapo_refusals_are_one_line_each():
    assert get_algorithm("sapo").errors(AlgorithmConfig(name="sapo")) == []
    assert get_algorithm("sapo").errors(AlgorithmConfig(name="sapo", dual_clip=3.0))[0].startswith(
        "algorithm.dual_clip=3.0: sapo has no clipped objective")
    good = load_config(RunConfig, overrides=["algorithm.name=sapo"])
    assert not [e for e in range_errors(good) if "sapo" in e]


@pytest.mark.parametrize("field,value", [("sapo_tau_pos", "0"), ("sapo_tau_neg", "-1.0")])
def test_a_temperature_must_be_positive(field, value):
    cfg = load_config(RunConfig, overrides=["algorithm.name=sapo", f"algorithm.{field}={value}"])
    assert [e for e in range_errors(cfg) if field in e] == [f"algorithm.{field}={float(value)} must be > 0"]
