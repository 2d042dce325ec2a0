"""RPO (DPO + alpha * the chosen answer's per-token NLL) against numbers worked out by hand.

Two pairs, summed log-probs (float64), beta 0.1:

    pair  chosen  tokens  ref_chosen  rejected  ref_rejected   delta                 NLL_w
    0     -4      2       -5          -6        -5             1 - (-1) = 2          4 / 2 = 2
    1     -9      3       -9.5        -8        -7             0.5 - (-1) = 1.5      9 / 3 = 3

Per pair ``-log sigmoid(beta * delta) + alpha * NLL_w``, the mean over the 2 pairs. The gradient
with respect to a pair's chosen log-prob sum: ``-beta * sigmoid(-beta * delta) / 2`` from DPO and
``-alpha / tokens / 2`` from the NLL.
"""

from __future__ import annotations

import math

import pytest
import torch

from megarl.algorithms.dpo import PairLogprobs, dpo_loss
from megarl.algorithms.rpo import chosen_nll
from megarl.config.supervised import DpoConfig

F64 = torch.float64
DELTA, NLL, TOKENS = (2.0, 1.5), (2.0, 3.0), (2.0, 3.0)


def sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def pairs() -> PairLogprobs:
    t = lambda *v: torch.tensor(v, dtype=F64)  # noqa: E731
    return PairLogprobs(chosen=t(-4.0, -9.0).requires_grad_(), rejected=t(-6.0, -8.0), ref_chosen=t(-5.0, -9.5),
                        ref_rejected=t(-5.0, -7.0), chosen_tokens=t(2.0, 3.0), rejected_tokens=t(4.0, 4.0))


def test_the_chosen_answers_nll_by_hand():
    p = pairs()
    torch.testing.assert_close(chosen_nll(p.chosen, p.chosen_tokens).detach(), torch.tensor(NLL, dtype=F64))
    assert chosen_nll(torch.tensor([0.0]), torch.tensor([0.0])).item() == 0.0  # an empty answer: no NaN


@pytest.mark.parametrize("alpha", [0.0, 0.5, 1.0])
def test_dpo_plus_alpha_nll_by_hand(alpha):
    p = pairs()
    loss, metrics = dpo_loss(p, DpoConfig(beta=0.1, rpo_alpha=alpha), denom=2.0)
    per_pair = [-math.log(sigmoid(0.1 * d)) + alpha * n for d, n in zip(DELTA, NLL, strict=True)]
    assert loss.item() == pytest.approx(sum(per_pair) / 2, abs=1e-14)
    assert metrics["dpo_loss"].item() == pytest.approx(sum(per_pair) / 2, abs=1e-14)
    loss.backward()
    grads = [(-0.1 * sigmoid(-0.1 * d) - alpha / n) / 2 for d, n in zip(DELTA, TOKENS, strict=True)]
    torch.testing.assert_close(p.chosen.grad, torch.tensor(grads, dtype=F64), atol=1e-14, rtol=0)
    # the implicit rewards and accuracy are DPO's whatever alpha
    assert metrics["dpo/margin"].item() == pytest.approx(0.1 * sum(DELTA) / 2, abs=1e-14)


def test_alpha_zero_is_plain_dpo_bit_for_bit():
    plain, _ = dpo_loss(pairs(), DpoConfig(beta=0.1), denom=2.0)
    rpo, _ = dpo_loss(pairs(), DpoConfig(beta=0.1, rpo_alpha=0.0), denom=2.0)
    assert torch.equal(plain, rpo)
    assert DpoConfig().rpo_alpha == 0.0


def test_the_nll_adds_to_ipo_too():
    p = pairs()
    ipo, _ = dpo_loss(p, DpoConfig(beta=0.1, loss_type="ipo"), denom=2.0)
    rpo, _ = dpo_loss(p, DpoConfig(beta=0.1, loss_type="ipo", rpo_alpha=2.0), denom=2.0)
    assert (rpo - ipo).item() == pytest.approx(2.0 * sum(NLL) / 2, abs=1e-12)


@pytest.mark.parametrize("settings,line", [
    (DpoConfig(rpo_alpha=-1.0), "dpo.rpo_alpha must be a number >= 0, got -1.0"),
    (DpoConfig(rpo_alpha=float("nan")), "dpo.rpo_alpha must be a number >= 0, got nan"),
    (DpoConfig(rpo_alpha=1.0, loss_type="kto"), "dpo.rpo_alpha applies to pairs (loss_type sigmoid or ipo): kto's "
                                                "answers have no chosen one to add the NLL of"),
])
def test_bad_alphas_are_refused_in_one_line(settings, line):
    assert settings.problems() == [line]
    assert DpoConfig(rpo_alpha=1.0).problems() == [] and DpoConfig(rpo_alpha=0.5, loss_type="ipo").problems() == []
