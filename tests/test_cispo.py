"""CISPO against numbers worked out by hand: clipped, stop-gradient weights and every token's gradient.

Two sequences (float64), 3 and 1 valid tokens, padding with garbage (NaN advantages, huge
log-probs). Ratios r = exp(log pi - log pi_old):

    row 0: lp -1, -2, -0.5 against old -1.5, -2, -0.2  ->  r = e^0.5 (1.6487), 1, e^-0.3 (0.7408)
    row 1: lp -0.1 against old -0.1                    ->  r = 1

Advantages 1, -1, 2 (row 0) and -0.5 (row 1). Defaults: no lower bound, upper 1.28, so the
weights are w = 1.28, 1, e^-0.3 | 1, and per token l = -w * A * lp:

    1.28 * 1 * 1 = 1.28,  -(1 * -1 * -2) = -2,  e^-0.3 * 2 * 0.5 = e^-0.3  |  -(1 * -0.5 * -0.1) = -0.05

token-mean over the 4 tokens; the gradient is -w * A / 4 per token (w a constant). Token 0 has
A > 0 and r = 1.65 > 1.2: PPO's clip would give it no gradient, CISPO gives it -1.28 / 4.
"""

from __future__ import annotations

import math

import torch
from test_algorithm_edges import close, micro, rank_loss  # noqa: F401 (rank_loss is a fixture)

from megarl.algorithms import get_algorithm, policy_loss
from megarl.algorithms.base import PolicyMicroBatch
from megarl.config.schema import AlgorithmConfig

F64 = torch.float64
NAN = float("nan")
MASK = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]], dtype=F64)
LP = torch.tensor([[-1.0, -2.0, -0.5, 40.0], [-0.1, 60.0, 60.0, 60.0]], dtype=F64)
OLD = torch.tensor([[-1.5, -2.0, -0.2, 0.0], [-0.1, 0.0, 0.0, 0.0]], dtype=F64)
A = torch.tensor([[1.0, -1.0, 2.0, NAN], [-0.5, NAN, NAN, NAN]], dtype=F64)
E03 = math.exp(-0.3)


def run(cfg: AlgorithmConfig, denom: float = 4.0):
    lp = LP.clone().requires_grad_()
    mb = PolicyMicroBatch(logprobs=lp, old_logprobs=OLD, advantages=A, mask=MASK, denom=denom)
    loss, metrics = get_algorithm("cispo").policy_loss(cfg, mb)
    loss.backward()
    return loss, lp.grad, metrics


def test_cispo_defaults_leave_the_weight_unbounded_below():
    cfg = AlgorithmConfig(name="cispo")
    assert (cfg.clip_low, cfg.clip_high, cfg.aggregation) == (None, 0.28, "token-mean")


def test_token_mean_loss_and_gradient_by_hand():
    loss, grad, metrics = run(AlgorithmConfig(name="cispo"))
    close(loss, (1.28 - 2.0 + E03 - 0.05) / 4, atol=1e-12)
    # -w * A / 4; padding 0
    close(grad, [[-1.28 / 4, 1 / 4, -2 * E03 / 4, 0.0], [0.5 / 4, 0.0, 0.0, 0.0]], atol=1e-12)
    close(metrics["clip_fraction"], 1 / 4)  # token 0's weight was capped
    close(metrics["ratio_mean"], (math.exp(0.5) + 1 + E03 + 1) / 4, atol=1e-12)


def test_a_lower_bound_lifts_small_weights():
    # clip_low 0.2: token 2's weight max(e^-0.3, 0.8) = 0.8, so l = 0.8 * 2 * 0.5 = 0.8, gradient -0.8 * 2 / 4
    loss, grad, metrics = run(AlgorithmConfig(name="cispo", clip_low=0.2))
    close(loss, (1.28 - 2.0 + 0.8 - 0.05) / 4, atol=1e-12)
    close(grad[0, 2], -0.4, atol=1e-12)
    close(metrics["clip_fraction"], 2 / 4)


def test_every_token_keeps_its_gradient_where_ppo_clips_it():
    _, grad, _ = run(AlgorithmConfig(name="cispo"))
    lp = LP.clone().requires_grad_()
    loss, _ = policy_loss(lp, OLD, torch.nan_to_num(A), MASK, clip_low=0.2, clip_high=0.2, denom=4.0)
    loss.backward()
    assert lp.grad[0, 0] == 0.0 and grad[0, 0] != 0.0  # PPO's clip drops token 0, CISPO does not
    assert (grad[MASK.bool()] != 0).all()


def test_cispo_refuses_a_dual_clip():
    errors = get_algorithm("cispo").errors
    assert errors(AlgorithmConfig(name="cispo")) == []
    assert errors(AlgorithmConfig(name="cispo", dual_clip=3.0))[0].startswith("algorithm.dual_clip=3.0: cispo has")


def test_the_rank_runs_cispo_from_the_config(rank_loss):  # noqa: F811
    rl_fns, get = rank_loss
    loss_fn = get(rl_fns.train_policy, "token-mean", name="cispo")
    lp = LP.float().requires_grad_()
    mb = micro(mask=MASK.float(), advantages=A.float(), old_logprobs=OLD.float(), denom=4.0)
    result = loss_fn({"lp": lp, "ent": torch.zeros(2, 4)}, mb)
    total, out = result.loss, result.metrics
    close(out["pg_loss"], (1.28 - 2.0 + E03 - 0.05) / 4, atol=1e-6)
    total.backward()
    close(lp.grad, [[-1.28 / 4, 1 / 4, -2 * E03 / 4, 0.0], [0.5 / 4, 0.0, 0.0, 0.0]], atol=1e-6)
