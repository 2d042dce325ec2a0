"""megarl.algorithms against hand-computed values.

Every expected number is a literal worked out by hand in the comment beside it
(float64 inputs, so the tolerances only absorb the rounding of those literals).
Padding positions carry garbage (large numbers, inf, NaN) on purpose: it must
change neither values nor gradients.
"""

from __future__ import annotations

import pytest
import torch

from megarl.algorithms import (
    aggregate,
    broadcast,
    discounted_returns,
    dynamic_sampling_mask,
    entropy_loss,
    gae,
    grpo_advantages,
    kl_estimate,
    kl_loss,
    kl_reward_penalty,
    masked_mean,
    masked_sum,
    masked_var,
    overlong_penalty,
    policy_loss,
    reinforce_pp_advantages,
    rloo_advantages,
    token_rewards,
    value_loss,
    whiten,
)

F64 = torch.float64


def T(rows) -> torch.Tensor:  # noqa: N802 - a short tensor literal
    return torch.tensor(rows, dtype=F64)


def close(actual: torch.Tensor, expected, atol: float = 1e-6) -> None:
    torch.testing.assert_close(actual.to(F64), torch.as_tensor(expected, dtype=F64), atol=atol, rtol=0)


# x = [[1, 2, 3], [4, pad, pad]] with NaN/huge padding
X = T([[1.0, 2.0, 3.0], [4.0, float("nan"), 1e30]])
M = T([[1, 1, 1], [1, 0, 0]])


# ---------------------------------------------------------------- masked.py

def test_masked_sum_mean():
    close(masked_sum(X, M), 10.0)  # 1 + 2 + 3 + 4
    close(masked_mean(X, M), 2.5)  # 10 / 4
    close(masked_sum(X, M, dim=-1), [6.0, 4.0])  # 1+2+3 ; 4
    close(masked_mean(X, M, dim=-1), [2.0, 4.0])  # 6/3 ; 4/1
    close(masked_mean(X, M.bool(), dim=-1), [2.0, 4.0])  # a bool mask reads the same
    # an all-masked row has mean 0, not NaN
    close(masked_mean(X, T([[1, 1, 1], [0, 0, 0]]), dim=-1), [2.0, 0.0])


def test_masked_var():
    # valid 1,2,3,4: mean 2.5, squared deviations 2.25+0.25+0.25+2.25 = 5
    close(masked_var(X, M), 5.0 / 3.0)  # unbiased: 5 / (4 - 1)
    close(masked_var(X, M, unbiased=False), 1.25)  # biased: 5 / 4


def test_whiten_values_and_moments():
    # (x - 2.5) / sqrt(5/3); sqrt(5/3) = 1.2909944: 1.5/1.2909944 = 1.1618950, 0.5/1.2909944 = 0.3872983
    w = whiten(X, M)
    close(w, [[-1.1618950, -0.3872983, 0.3872983], [1.1618950, 0.0, 0.0]])
    # shift_mean=False adds the mean 2.5 back
    close(whiten(X, M, shift_mean=False), [[1.3381050, 2.1127017, 2.8872983], [3.6618950, 0.0, 0.0]])

    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 7, generator=g, dtype=F64) * 3.0 + 5.0
    lengths = torch.tensor([7, 3, 5, 1])
    mask = torch.arange(7)[None, :] < lengths[:, None]
    x[~mask] = 1e6  # padding garbage
    w = whiten(x, mask)
    valid = w[mask]
    close(valid.mean(), 0.0, atol=1e-9)
    close(valid.var(unbiased=True), 1.0, atol=1e-6)
    assert torch.all(w[~mask] == 0)


def test_aggregate_modes():
    loss = T([[1.0, 2.0, 3.0], [4.0, 100.0, -50.0]])
    close(aggregate(loss, M, "token-mean"), 2.5)  # (1+2+3+4) / 4 tokens
    close(aggregate(loss, M, "seq-mean-token-mean"), 3.0)  # (6/3 + 4/1) / 2 = (2 + 4) / 2
    close(aggregate(loss, M, "seq-mean-token-sum"), 5.0)  # (6 + 4) / 2
    close(aggregate(loss, M, "seq-mean-token-sum", norm_len=3), 10.0 / 6.0)  # (6/3 + 4/3) / 2
    # global normalisers: token-mean 10 / 8 ; seq-mean-token-mean (2 + 4) / 4
    close(aggregate(loss, M, "token-mean", denom=8), 1.25)
    close(aggregate(loss, M, "seq-mean-token-mean", denom=4), 1.5)
    # a fully masked sequence does not count as a sequence: still (2 + 4) / 2
    loss3 = torch.cat([loss, T([[7.0, 7.0, 7.0]])])
    mask3 = torch.cat([M, T([[0, 0, 0]])])
    close(aggregate(loss3, mask3, "seq-mean-token-mean"), 3.0)
    close(aggregate(loss3, mask3, "token-mean"), 2.5)
    # an empty batch gives 0
    close(aggregate(loss, torch.zeros_like(M), "token-mean"), 0.0)
    with pytest.raises(ValueError, match="aggregation mode"):
        aggregate(loss, M, "sum")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="norm_len"):
        aggregate(loss, M, "seq-mean-token-sum", norm_len=0)


def test_aggregate_gradients():
    loss = T([[1.0, 2.0, 3.0], [4.0, 100.0, -50.0]]).requires_grad_()
    aggregate(loss, M, "token-mean").backward()
    close(loss.grad, [[0.25, 0.25, 0.25], [0.25, 0.0, 0.0]])  # 1 / 4 tokens
    loss.grad = None
    aggregate(loss, M, "seq-mean-token-mean").backward()
    # row 0: 1 / (3 tokens * 2 seqs) = 1/6; row 1: 1 / (1 token * 2 seqs) = 1/2
    close(loss.grad, [[1 / 6, 1 / 6, 1 / 6], [0.5, 0.0, 0.0]])
    loss.grad = None
    aggregate(loss, M, "seq-mean-token-sum", norm_len=4).backward()
    close(loss.grad, [[0.125, 0.125, 0.125], [0.125, 0.0, 0.0]])  # 1 / (norm_len 4 * 2 seqs)


# ---------------------------------------------------------------- kl.py

LOGP = T([[-1.0, -2.0, -0.5]])
REF = T([[-1.5, -1.0, -0.5]])  # d = logp - ref = [0.5, -1.0, 0.0]


def test_kl_estimators_values():
    close(kl_estimate(LOGP, REF, "k1"), [[0.5, -1.0, 0.0]])  # d
    close(kl_estimate(LOGP, REF, "k2"), [[0.125, 0.5, 0.0]])  # d^2 / 2
    # k3 = exp(-d) + d - 1: exp(-0.5) + 0.5 - 1 = 0.6065307 - 0.5 = 0.1065307 ; e - 1 - 1 = 0.7182818
    close(kl_estimate(LOGP, REF, "k3"), [[0.1065307, 0.7182818, 0.0]])
    close(kl_estimate(LOGP, REF, "k1", clamp=0.3), [[0.3, -0.3, 0.0]])
    with pytest.raises(ValueError, match="estimator"):
        kl_estimate(LOGP, REF, "k4")  # type: ignore[arg-type]


def test_kl_estimators_expectation_and_sign():
    # p = [0.5, 0.5] (policy), q = [0.25, 0.75] (reference):
    # KL(p||q) = 0.5 ln 2 + 0.5 ln(2/3) = 0.3465736 - 0.2027326 = 0.1438410
    logp = torch.log(T([0.5, 0.5]))
    logq = torch.log(T([0.25, 0.75]))
    weights = T([0.5, 0.5])  # E_p over the two outcomes, exactly
    # k1 and k3 are unbiased: their exact expectation is the KL
    close((weights * kl_estimate(logp, logq, "k1")).sum(), 0.1438410)
    # k3 per outcome: d = ln 2 -> 0.5 + 0.6931472 - 1 = 0.1931472; d = ln(2/3) -> 1.5 - 0.4054651 - 1 = 0.0945349
    close(kl_estimate(logp, logq, "k3"), [0.1931472, 0.0945349])
    close((weights * kl_estimate(logp, logq, "k3")).sum(), 0.1438410)
    # k2 is biased: 0.5 * (0.5 * 0.4804530 + 0.5 * 0.1644020) = 0.1612138
    close((weights * kl_estimate(logp, logq, "k2")).sum(), 0.1612138)

    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(64, 32, generator=g) * 4, torch.randn(64, 32, generator=g) * 4
    assert torch.all(kl_estimate(a, b, "k3") >= 0)
    assert torch.all(kl_estimate(a, b, "k2") >= 0)
    assert torch.any(kl_estimate(a, b, "k1") < 0)


def test_k3_is_finite_for_extreme_log_ratios():
    logp = torch.tensor([[0.0, -200.0]], requires_grad=True)
    ref = torch.tensor([[-200.0, 0.0]])
    kl = kl_estimate(logp, ref, "k3")
    assert torch.isfinite(kl).all()
    kl.sum().backward()
    assert torch.isfinite(logp.grad).all()


def test_kl_reward_penalty():
    ref = T([[-1.5, -1.0, 5.0]])  # third token is padding: d = -5.5 there
    mask = T([[1, 1, 0]])
    logp = LOGP.clone().requires_grad_()
    pen = kl_reward_penalty(logp, ref, mask, beta=0.1, estimator="k1")
    close(pen, [[-0.05, 0.1, 0.0]])  # -0.1 * [0.5, -1.0], masked 0
    assert not pen.requires_grad


# ---------------------------------------------------------------- advantages.py

def test_gae_three_tokens():
    # gamma = 0.9, lam = 0.8, gamma*lam = 0.72; rewards [0, 0, 1], values [0.5, 0.6, 0.7]
    # delta2 = 1 + 0.9*0   - 0.7 = 0.3      A2 = 0.3
    # delta1 = 0 + 0.9*0.7 - 0.6 = 0.03     A1 = 0.03 + 0.72*0.3   = 0.246
    # delta0 = 0 + 0.9*0.6 - 0.5 = 0.04     A0 = 0.04 + 0.72*0.246 = 0.21712
    # returns = A + V = [0.71712, 0.846, 1.0]
    adv, ret = gae(T([[0.0, 0.0, 1.0]]), T([[0.5, 0.6, 0.7]]), T([[1, 1, 1]]), gamma=0.9, lam=0.8)
    close(adv, [[0.21712, 0.246, 0.3]])
    close(ret, [[0.71712, 0.846, 1.0]])


def test_gae_right_padding():
    # row 0: the 3-token case above, padded to 5 with garbage rewards/values
    # row 1: 2 tokens, rewards [0.2, 0.5], values [0.1, 0.3]
    #   delta1 = 0.5 - 0.3 = 0.2                  A1 = 0.2
    #   delta0 = 0.2 + 0.9*0.3 - 0.1 = 0.37       A0 = 0.37 + 0.72*0.2 = 0.514
    #   returns [0.614, 0.5]
    rewards = T([[0.0, 0.0, 1.0, 7.0, 7.0], [0.2, 0.5, 3.0, 3.0, 3.0]])
    values = T([[0.5, 0.6, 0.7, 9.0, 9.0], [0.1, 0.3, -4.0, -4.0, -4.0]])
    mask = T([[1, 1, 1, 0, 0], [1, 1, 0, 0, 0]])
    adv, ret = gae(rewards, values, mask, gamma=0.9, lam=0.8)
    close(adv, [[0.21712, 0.246, 0.3, 0.0, 0.0], [0.514, 0.2, 0.0, 0.0, 0.0]])
    close(ret, [[0.71712, 0.846, 1.0, 0.0, 0.0], [0.614, 0.5, 0.0, 0.0, 0.0]])
    assert not adv.requires_grad


def test_discounted_returns():
    # gamma 0.5, rewards [1, 0, 2, pad]: G2 = 2, G1 = 0 + 0.5*2 = 1, G0 = 1 + 0.5*1 = 1.5
    g = discounted_returns(T([[1.0, 0.0, 2.0, 5.0]]), T([[1, 1, 1, 0]]), gamma=0.5)
    close(g, [[1.5, 1.0, 2.0, 0.0]])


def test_token_rewards():
    scores = T([1.0, -0.5])
    mask = T([[1, 1, 1, 0], [1, 0, 0, 0]])
    # score on the last valid token (t=2 in row 0, t=0 in row 1)
    close(token_rewards(scores, mask), [[0.0, 0.0, 1.0, 0.0], [-0.5, 0.0, 0.0, 0.0]])
    kl = T([[0.1, 0.2, 0.3, 9.0], [0.4, 9.0, 9.0, 9.0]])
    # minus beta*kl = 0.5*kl on valid tokens: row0 [-0.05, -0.1, 1 - 0.15], row1 [-0.5 - 0.2]
    close(token_rewards(scores, mask, kl, beta=0.5), [[-0.05, -0.1, 0.85, 0.0], [-0.7, 0.0, 0.0, 0.0]])
    # a sequence without valid tokens gets nothing
    close(token_rewards(T([2.0]), T([[0, 0]])), [[0.0, 0.0]])


def test_grpo_advantages():
    # group [1, 2, 3, 6]: mean 3, deviations [-2, -1, 0, 3], squares sum 14
    # unbiased std = sqrt(14 / 3) = 2.1602469 -> [-0.9258201, -0.4629100, 0, 1.3887301]
    # group [0, 0, 0, 0]: all identical -> 0
    scores = T([1.0, 2.0, 3.0, 6.0, 0.0, 0.0, 0.0, 0.0])
    close(grpo_advantages(scores, 4), [-0.9258201, -0.4629100, 0.0, 1.3887301, 0, 0, 0, 0], atol=1e-6)
    # Dr.GRPO: only mean-centred
    close(grpo_advantages(scores, 4, norm_std=False), [-2.0, -1.0, 0.0, 3.0, 0, 0, 0, 0])
    # binary rewards [1, 0, 0, 1]: mean 0.5, unbiased std sqrt(4*0.25/3) = 0.5773503 -> +-0.8660254
    close(grpo_advantages(T([1.0, 0.0, 0.0, 1.0]), 4), [0.8660254, -0.8660254, -0.8660254, 0.8660254], atol=2e-6)
    # integer scores are accepted
    close(grpo_advantages(torch.tensor([1, 0]), 2, norm_std=False), [0.5, -0.5])
    with pytest.raises(ValueError, match="groups of 3"):
        grpo_advantages(scores, 3)


def test_rloo_advantages():
    # group [1, 2, 3, 6]: others' means 11/3, 10/3, 3, 2 -> [1 - 11/3, 2 - 10/3, 3 - 3, 6 - 2]
    close(rloo_advantages(T([1.0, 2.0, 3.0, 6.0]), 4), [-8 / 3, -4 / 3, 0.0, 4.0])
    # two groups of 2: [1, 3] -> [-2, 2]; [5, 5] -> [0, 0]
    close(rloo_advantages(T([1.0, 3.0, 5.0, 5.0]), 2), [-2.0, 2.0, 0.0, 0.0])
    with pytest.raises(ValueError, match="group_size >= 2"):
        rloo_advantages(T([1.0, 2.0]), 1)


def test_reinforce_pp_advantages():
    # rewards row0 [0, 0, 1], row1 [0, -1, pad]; gamma 1: return-to-go [1, 1, 1], [-1, -1]
    # valid returns 1,1,1,-1,-1: mean 0.2, deviations 0.8 (x3), -1.2 (x2): squares 1.92 + 2.88 = 4.8
    # unbiased var 4.8 / 4 = 1.2, std 1.0954451: 0.8/std = 0.7302967, -1.2/std = -1.0954451
    rewards = T([[0.0, 0.0, 1.0], [0.0, -1.0, 5.0]])
    mask = T([[1, 1, 1], [1, 1, 0]])
    adv = reinforce_pp_advantages(rewards, mask, gamma=1.0)
    close(adv, [[0.7302967, 0.7302967, 0.7302967], [-1.0954451, -1.0954451, 0.0]])


def test_broadcast():
    close(broadcast(T([2.0, -1.0]), T([[1, 1, 0], [1, 0, 0]])), [[2.0, 2.0, 0.0], [-1.0, 0.0, 0.0]])


# ---------------------------------------------------------------- losses.py

def _policy_batch():
    """Tokens (A, ratio): row 0 a=(+1, 1.1) b=(+1, 1.5) c=(-1, 0.5) pad; row 1 d=(-1, 1.5) e=(+1, 0.5) pad pad."""
    ratios = T([[1.1, 1.5, 0.5, 1.0], [1.5, 0.5, 1.0, 1.0]])
    logp = torch.log(ratios)
    logp[0, 3] = 1000.0  # padding garbage: exp would overflow
    logp[1, 2:] = float("nan")
    old = torch.zeros_like(logp)
    adv = T([[1.0, 1.0, -1.0, 7.0], [-1.0, 1.0, 7.0, 7.0]])
    mask = T([[1, 1, 1, 0], [1, 1, 0, 0]])
    return logp.requires_grad_(), old, adv, mask


def test_policy_loss_values_metrics_and_gradient():
    logp, old, adv, mask = _policy_batch()
    # clip 0.2: ratio range [0.8, 1.2]; l = max(-A r, -A clip(r))
    # a: max(-1.1, -1.1) = -1.1          unclipped
    # b: max(-1.5, -1.2) = -1.2          clipped
    # c: max( 0.5,  0.8) =  0.8          clipped
    # d: max( 1.5,  1.2) =  1.5          unclipped (pessimistic side)
    # e: max(-0.5, -0.8) = -0.5          unclipped
    # token-mean: (-1.1 - 1.2 + 0.8 + 1.5 - 0.5) / 5 = -0.5 / 5 = -0.1
    loss, metrics = policy_loss(logp, old, adv, mask)
    close(loss, -0.1)
    close(metrics["clip_fraction"], 0.4)  # b, c of 5
    close(metrics["dual_clip_fraction"], 0.0)
    close(metrics["ratio_mean"], 1.02)  # (1.1 + 1.5 + 0.5 + 1.5 + 0.5) / 5
    close(metrics["ratio_max"], 1.5)
    # approx KL = mean(r - 1 - ln r): 1.1 -> 0.0046898; 1.5 -> 0.0945349 (x2); 0.5 -> 0.1931472 (x2)
    # (0.0046898 + 0.1890698 + 0.3862944) / 5 = 0.1160108
    close(metrics["approx_kl"], 0.1160108)
    assert all(not v.requires_grad for v in metrics.values())
    # d loss / d logp = -A * r / N (N = 5) where unclipped, 0 where clipped, 0 on padding
    # a: -1.1/5 = -0.22; b: 0; c: 0; d: 1.5/5 = 0.3; e: -0.5/5 = -0.1
    loss.backward()
    close(logp.grad, [[-0.22, 0.0, 0.0, 0.0], [0.3, -0.1, 0.0, 0.0]])


def test_policy_loss_aggregations_differ():
    logp, old, adv, mask = _policy_batch()
    # per-sequence: row 0 tokens [-1.1, -1.2, 0.8] (sum -1.5, mean -0.5), row 1 [1.5, -0.5] (sum 1.0, mean 0.5)
    close(policy_loss(logp, old, adv, mask, aggregation="seq-mean-token-mean")[0], 0.0)  # (-0.5 + 0.5) / 2
    close(policy_loss(logp, old, adv, mask, aggregation="seq-mean-token-sum")[0], -0.25)  # (-1.5 + 1.0) / 2
    loss = policy_loss(logp, old, adv, mask, aggregation="seq-mean-token-sum", norm_len=4)[0]
    close(loss, -0.0625)  # (-1.5/4 + 1.0/4) / 2
    loss.backward()
    # gradient -A r / (norm_len 4 * 2 seqs): a -1.1/8, d 1.5/8, e -0.5/8
    close(logp.grad, [[-0.1375, 0.0, 0.0, 0.0], [0.1875, -0.0625, 0.0, 0.0]])


def test_policy_loss_clip_higher():
    # A = +1 at r = 1.25 and A = -1 at r = 0.7 (one row, two tokens)
    logp = torch.log(T([[1.25, 0.7]])).requires_grad_()
    old = torch.zeros_like(logp)
    adv = T([[1.0, -1.0]])
    mask = T([[1, 1]])
    # symmetric 0.2: max(-1.25, -1.2) = -1.2 (clipped); max(0.7, 0.8) = 0.8 (clipped): mean -0.2
    loss, m = policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.2)
    close(loss, -0.2)
    close(m["clip_fraction"], 1.0)
    # clip-higher 0.28: 1.25 < 1.28 -> -1.25 unclipped; low side unchanged 0.8: mean (-1.25 + 0.8)/2 = -0.225
    loss, m = policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28)
    close(loss, -0.225)
    close(m["clip_fraction"], 0.5)
    loss.backward()
    close(logp.grad, [[-0.625, 0.0]])  # -A r / N = -1.25 / 2 ; clipped token 0


def test_policy_loss_dual_clip():
    # c = 3, clip 0.2; tokens (A, r): (-1, 4) (-1, 2) (+1, 4) (-2, 5)
    # max(pg1, pg2):  max(4, 1.2) = 4 ; max(2, 1.2) = 2 ; max(-4, -1.2) = -1.2 ; max(10, 2.4) = 10
    # dual (A < 0): min(4, 3) = 3 ; min(2, 3) = 2 ; (A > 0: -1.2 kept) ; min(10, 6) = 6
    logp = torch.log(T([[4.0, 2.0, 4.0, 5.0]])).requires_grad_()
    old = torch.zeros_like(logp)
    adv = T([[-1.0, -1.0, 1.0, -2.0]])
    mask = T([[1, 1, 1, 1]])
    loss, m = policy_loss(logp, old, adv, mask, dual_clip=3.0)
    close(loss, 2.45)  # (3 + 2 - 1.2 + 6) / 4
    close(m["dual_clip_fraction"], 0.5)  # tokens 0 and 3
    close(m["clip_fraction"], 0.25)  # token 2
    loss.backward()
    close(logp.grad, [[0.0, 0.5, 0.0, 0.0]])  # only token 1 unbounded: -A r / N = 2 / 4
    # without dual clip: (4 + 2 - 1.2 + 10) / 4 = 3.7
    close(policy_loss(logp, old, adv, mask)[0], 3.7)
    with pytest.raises(ValueError, match="dual_clip"):
        policy_loss(logp, old, adv, mask, dual_clip=1.0)


def test_policy_loss_sequence_advantages():
    # ratio 1 everywhere: loss tokens are -A; row 0 A = 1 on 3 tokens, row 1 A = -1 on 1 token
    logp = torch.zeros(2, 3)
    adv = torch.tensor([1.0, -1.0])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    close(policy_loss(logp, logp, adv, mask)[0], -0.5)  # (-3 + 1) / 4
    close(policy_loss(logp, logp, adv, mask, aggregation="seq-mean-token-mean")[0], 0.0)  # (-1 + 1) / 2


def test_value_loss():
    # clip 0.2; tokens (old, v, R):
    # t1 (0.5,  1.0, 1.0): v_clip = 0.5 + 0.2 = 0.7; max(0, 0.09) = 0.09 -> 0.045 (clipped)
    # t2 (0.5,  0.6, 1.0): v_clip = 0.6;              max(0.16, 0.16) -> 0.08
    # t3 (0.0, -0.5, 1.0): v_clip = -0.2; max(2.25, 1.44) = 2.25 -> 1.125
    # token-mean: (0.045 + 0.08 + 1.125) / 3 = 1.25 / 3
    old = T([[0.5, 0.5], [0.0, 3.0]])
    values = T([[1.0, 0.6], [-0.5, 1e3]]).requires_grad_()
    returns = T([[1.0, 1.0], [1.0, -1e3]])
    mask = T([[1, 1], [1, 0]])
    loss, m = value_loss(values, old, returns, mask, clip=0.2)
    close(loss, 1.25 / 3)
    close(m["clip_fraction"], 1 / 3)
    loss.backward()
    # t1: clipped branch, v - old out of range -> 0; t2: (v - R)/3 = -0.4/3; t3: -1.5/3 = -0.5; pad 0
    close(values.grad, [[0.0, -0.4 / 3], [-0.5, 0.0]])
    # unclipped: 0.5 * (0 + 0.16 + 2.25) / 3 = 0.4016667
    close(value_loss(values, old, returns, mask)[0], 0.4016667)


def test_value_loss_explained_variance():
    # R = [1, 2, 3] (unbiased var 1), V = [1, 2, 2]: residual [0, 0, 1], mean 1/3,
    # unbiased var (1/9 + 1/9 + 4/9) / 2 = 1/3 -> EV = 1 - 1/3 = 2/3
    values = T([[1.0, 2.0, 2.0, -100.0]])
    returns = T([[1.0, 2.0, 3.0, 100.0]])
    mask = T([[1, 1, 1, 0]])
    _, m = value_loss(values, values, returns, mask)
    close(m["explained_variance"], 2 / 3)
    close(m["value_mean"], 5 / 3)
    # constant returns: EV reported as 0
    _, m = value_loss(values, values, T([[1.0, 1.0, 1.0, 5.0]]), mask)
    close(m["explained_variance"], 0.0)


def test_entropy_loss():
    ent = T([[1.0, 2.0, 9.0], [3.0, 9.0, 9.0]])
    mask = T([[1, 1, 0], [1, 0, 0]])
    close(entropy_loss(ent, mask), -2.0)  # -(1 + 2 + 3) / 3
    close(entropy_loss(ent, mask, "seq-mean-token-mean"), -2.25)  # -((1+2)/2 + 3) / 2


def test_kl_loss():
    # d = [0.5, -1.0, pad]; k3 = [0.1065307, 0.7182818]: token mean 0.4124062
    logp = T([[-1.0, -2.0, 1000.0]]).requires_grad_()
    ref = T([[-1.5, -1.0, -1000.0]])
    mask = T([[1, 1, 0]])
    loss = kl_loss(logp, ref, mask, "k3")
    close(loss, 0.4124062)
    loss.backward()
    # d k3 / d logp = 1 - exp(-d): 1 - 0.6065307 = 0.3934693, 1 - e = -1.7182818; / 2 tokens
    close(logp.grad, [[0.1967347, -0.8591409, 0.0]])
    close(kl_loss(logp, ref, mask, "k1"), -0.25)  # (0.5 - 1) / 2
    close(kl_loss(logp, ref, mask, "k2"), 0.3125)  # (0.125 + 0.5) / 2


# ---------------------------------------------------------------- filters.py

def test_dynamic_sampling_mask():
    scores = T([1, 1, 1, 0, 1, 0, 0, 0, 0, 0.5, 0.5, 0.5001])
    keep, kept = dynamic_sampling_mask(scores, 3)
    # groups: [1,1,1] same, [0,1,0] mixed, [0,0,0] same, [.5,.5,.5001] mixed
    assert keep.tolist() == [False] * 3 + [True] * 3 + [False] * 3 + [True] * 3
    assert kept == 2
    keep, kept = dynamic_sampling_mask(scores, 3, atol=1e-3)  # spread 1e-4 <= atol: dropped
    assert keep.tolist() == [False] * 3 + [True] * 3 + [False] * 6
    assert kept == 1
    with pytest.raises(ValueError, match="groups of 5"):
        dynamic_sampling_mask(scores, 5)


def test_overlong_penalty_boundaries():
    # max_len 100, buffer 20: free up to 80, linear to -1 at 100, -1 beyond
    # 81 -> (80 - 81) / 20 = -0.05 ; 90 -> -10/20 = -0.5 ; 100 -> -1
    lengths = torch.tensor([0, 80, 81, 90, 100, 101, 150])
    close(overlong_penalty(lengths, 100, 20), [0.0, 0.0, -0.05, -0.5, -1.0, -1.0, -1.0])
    close(overlong_penalty(lengths, 100, 20, penalty_factor=0.5), [0.0, 0.0, -0.025, -0.25, -0.5, -0.5, -0.5])
    with pytest.raises(ValueError, match="buffer_len"):
        overlong_penalty(lengths, 100, 0)
    with pytest.raises(ValueError, match="buffer_len"):
        overlong_penalty(lengths, 10, 20)

