"""Clip-Cov and KL-Cov against numbers worked out by hand.

Two sequences (float64), 3 and 2 valid tokens, padding with garbage; advantages 1 | -1:

    token            t00    t01    t02    t10    t11
    log pi           -1     -2     -0.5   -0.2   -3       mean -1.34
    A                 1      1      1     -1     -1       mean  0.2
    cov             0.272 -0.528  0.672 -1.368  1.992    (log pi + 1.34) * (A - 0.2)
    log r            0.2    0     -0.1    0     -0.5

KL-Cov, cov_fraction 0.4: int(0.4 * 5) = 2 tokens of highest covariance, t11 and t02, get
``+ |log r|`` (coefficient 1); per token l = -A r (+ |log r|), token-mean over 5.

Clip-Cov, PPO's clip 0.2: t00 (r = 1.22, A > 0) and t11 (r = 0.61, A < 0) are clipped. With the
band (0.5, 5) the only unclipped candidate is t02 (t11's covariance is higher, but PPO clipped it):
cov_fraction 0.2 draws max(1, int(1.0)) = 1 token, t02, whose term becomes 0.
"""

from __future__ import annotations

import math

import pytest
import torch

from megarl.algorithms import get_algorithm, policy_loss
from megarl.algorithms.base import PolicyMicroBatch
from megarl.algorithms.entropy_cov import random_selection, selected_count, token_covariance
from megarl.algorithms.registry import algorithm_errors
from megarl.config.loader import load_config
from megarl.config.schema import AlgorithmConfig, RunConfig
from megarl.validation.ranges import range_errors

F64 = torch.float64
MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]], dtype=F64)
LP = torch.tensor([[-1.0, -2.0, -0.5, 40.0], [-0.2, -3.0, 60.0, 60.0]], dtype=F64)
OLD = torch.tensor([[-1.2, -2.0, -0.4, 0.0], [-0.2, -2.5, 0.0, 0.0]], dtype=F64)
ADV = torch.tensor([1.0, -1.0], dtype=F64)
VALID_LP, VALID_A, VALID_LOG_R = [-1.0, -2.0, -0.5, -0.2, -3.0], [1.0, 1, 1, -1, -1], [0.2, 0.0, -0.1, 0.0, -0.5]


def close(actual: torch.Tensor, expected, atol: float = 1e-12) -> None:
    torch.testing.assert_close(actual.detach().to(F64), torch.as_tensor(expected, dtype=F64), atol=atol, rtol=0)


def run(cfg: AlgorithmConfig, mask: torch.Tensor = MASK):
    lp = LP.clone().requires_grad_()
    mb = PolicyMicroBatch(logprobs=lp, old_logprobs=OLD, advantages=ADV, mask=mask, denom=5.0)
    loss, metrics = get_algorithm(cfg.name).policy_loss(cfg, mb)
    loss.backward()
    return loss, lp.grad, metrics


def test_the_covariance_by_hand():
    mean_lp, mean_a = sum(VALID_LP) / 5, sum(VALID_A) / 5
    expected = [(lp - mean_lp) * (a - mean_a) for lp, a in zip(VALID_LP, VALID_A, strict=True)]
    close(torch.tensor(expected, dtype=F64), [0.272, -0.528, 0.672, -1.368, 1.992])
    cov = token_covariance(LP, ADV[:, None].expand(2, 4), MASK)
    close(cov[MASK.bool()], expected)
    close(cov[~MASK.bool()], [0.0, 0.0, 0.0])


def test_kl_cov_penalises_the_highest_covariance_tokens():
    loss, grad, metrics = run(AlgorithmConfig(name="kl_cov", cov_fraction=0.4))
    r = [math.exp(x) for x in VALID_LOG_R]
    picked = [False, False, True, False, True]  # t02, t11
    terms = [-a * ri + (abs(x) if p else 0.0) for a, ri, x, p in zip(VALID_A, r, VALID_LOG_R, picked, strict=True)]
    close(loss, sum(terms) / 5)
    # d/dlp: -A r, and sign(log r) where penalised (both negative here)
    grads = [(-a * ri - (1.0 if p else 0.0)) / 5 for a, ri, p in zip(VALID_A, r, picked, strict=True)]
    close(grad[MASK.bool()], grads)
    close(grad[~MASK.bool()], [0.0, 0.0, 0.0])
    close(metrics["cov_fraction"], 2 / 5)


def test_kl_cov_coefficient_and_fraction():
    # coefficient 3, fraction 0.2: only t11 (the highest), 3 * 0.5 added to the unclipped loss
    loss, _, _ = run(AlgorithmConfig(name="kl_cov", cov_fraction=0.2, kl_cov_coef=3.0))
    plain = sum(-a * math.exp(x) for a, x in zip(VALID_A, VALID_LOG_R, strict=True))
    close(loss, (plain + 1.5) / 5)


def test_clip_cov_detaches_a_drawn_token_in_the_band():
    loss, grad, metrics = run(AlgorithmConfig(name="clip_cov", cov_fraction=0.2, clip_cov_low=0.5))
    # terms: t00 clipped at -1.2, t01 -1, t02 detached 0, t10 +1, t11 clipped at 0.8
    close(loss, (-1.2 - 1.0 + 0.0 + 1.0 + 0.8) / 5)
    # gradient -A r / 5 on the unclipped, undetached tokens t01 and t10 only
    close(grad, [[0.0, -1 / 5, 0.0, 0.0], [1 / 5, 0.0, 0.0, 0.0]])
    close(metrics["clip_fraction"], 2 / 5)
    close(metrics["cov_fraction"], 1 / 5)


def test_clip_cov_with_an_empty_band_is_ppo():
    # the default band (1, 5) holds t11 only, which PPO clipped: nothing is detached
    loss, grad, metrics = run(AlgorithmConfig(name="clip_cov"))
    lp = LP.clone().requires_grad_()
    ppo, _ = policy_loss(lp, OLD, ADV, MASK, clip_low=0.2, clip_high=0.2, denom=5.0)
    ppo.backward()
    close(loss, ppo)
    close(grad, lp.grad)
    close(metrics["cov_fraction"], 0.0)


def test_the_draw_takes_the_count_from_the_candidates():
    candidates = torch.zeros(4, 5, dtype=torch.bool)
    candidates[0, :3] = candidates[2, 1:] = True  # 7 candidates
    picked = random_selection(candidates, 3, torch.Generator().manual_seed(0))
    assert int(picked.sum()) == 3 and not (picked & ~candidates).any()
    assert torch.equal(picked, random_selection(candidates, 3, torch.Generator().manual_seed(0)))
    assert torch.equal(random_selection(candidates, 10), candidates)  # fewer than the count: all of them
    assert [selected_count(f, torch.ones(1, 5000)) for f in (2e-4, 1e-3, 0.5)] == [1, 5, 2500]
    assert selected_count(0.5, torch.zeros(2, 3)) == 0


@pytest.mark.parametrize("name", ["clip_cov", "kl_cov"])
def test_no_valid_token_gives_zero(name):
    loss, grad, _ = run(AlgorithmConfig(name=name), mask=torch.zeros(2, 4, dtype=F64))
    assert loss == 0.0 and torch.equal(grad, torch.zeros_like(grad))


def test_settings_refused_in_one_line():
    for name in ("clip_cov", "kl_cov"):
        assert algorithm_errors(load_config(RunConfig, overrides=[f"algorithm.name={name}"])) == []
        assert get_algorithm(name).errors(AlgorithmConfig(name=name, dual_clip=3.0))[0].startswith(
            f"algorithm.dual_clip=3.0: {name}")
    assert get_algorithm("clip_cov").errors(AlgorithmConfig(name="clip_cov", clip_cov_low=5.0)) == [
        "algorithm.clip_cov_low=5.0 must be below clip_cov_high=5.0: the covariance band is empty"]
    bad = load_config(RunConfig, overrides=["algorithm.name=kl_cov", "algorithm.cov_fraction=0",
                                            "algorithm.kl_cov_coef=-1", "algorithm.clip_cov_high=.inf"])
    assert [e for e in range_errors(bad) if "cov" in e] == [
        "algorithm.cov_fraction=0.0 must be in (0, 1]", "algorithm.clip_cov_high=inf must be a finite number",
        "algorithm.kl_cov_coef=-1.0 must be > 0"]
