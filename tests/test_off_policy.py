"""Off-policy corrections (TIS, MIS, IcePop) and the mismatch metrics, against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch
from test_algorithm_edges import close, micro, rank_loss  # noqa: F401 (rank_loss is a fixture)

from megarl.algorithms.off_policy import mismatch_metrics, off_policy_correction

NAN = float("nan")
# log r = log pi_old - log mu: row 0 [0.5, -1.0, 0.0]; row 1 [1.0, 1.0, padding]
OLD = torch.tensor([[-1.0, -2.0, -0.5], [-0.2, -0.3, NAN]], dtype=torch.float64)
ROLLOUT = torch.tensor([[-1.5, -1.0, -0.5], [-1.2, -1.3, NAN]], dtype=torch.float64)
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]], dtype=torch.float64)
E = math.e


def test_tis_truncates_each_tokens_ratio_at_the_cap():
    fix = off_policy_correction("tis", OLD, ROLLOUT, MASK, cap=1.5)
    # r = e^0.5 = 1.6487 -> 1.5, e^-1 = 0.3679, 1; row 1: e = 2.718 -> 1.5 twice; padding 0
    close(fix.weights, [[1.5, 1 / E, 1.0], [1.5, 1.5, 0.0]])
    close(fix.keep, MASK)


def test_icepop_is_the_papers_masking_function():
    """IcePop's M(r) = r inside [low, high], 0 outside: kept tokens weighted by their ratio."""
    fix = off_policy_correction("icepop", OLD, ROLLOUT, MASK, low=0.3, high=1.7)
    # row 0: e^0.5 = 1.6487, e^-1 = 0.3679 and 1 all inside [0.3, 1.7]; row 1: e = 2.718 > 1.7 twice
    close(fix.weights, [[math.exp(0.5), 1 / E, 1.0], [0.0, 0.0, 0.0]])
    close(fix.keep, [[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    fix = off_policy_correction("icepop", OLD, ROLLOUT, MASK, low=0.5, high=1.5)
    close(fix.weights * fix.keep, [[0.0, 0.0, 1.0], [0.0, 0.0, 0.0]])  # 1.6487 > 1.5, 0.3679 < 0.5


def test_token_mask_drops_tokens_whose_ratio_leaves_the_band():
    fix = off_policy_correction("token_mask", OLD, ROLLOUT, MASK, low=0.5, high=1.5)
    close(fix.weights, torch.ones(2, 3))
    close(fix.keep, [[0.0, 0.0, 1.0], [0.0, 0.0, 0.0]])  # 1.6487 > 1.5, 0.3679 < 0.5, 2.718 > 1.5


def test_mis_drops_whole_sequences_by_their_geometric_mean_ratio():
    fix = off_policy_correction("mis", OLD, ROLLOUT, MASK, low=0.5, high=2.0)
    # row 0: exp((0.5 - 1.0 + 0.0) / 3) = 0.8465 inside [0.5, 2]; row 1: exp((1 + 1) / 2) = e > 2
    close(fix.keep, [[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    close(fix.weights, torch.ones(2, 3))


def test_none_keeps_everything_and_bad_bounds_are_refused():
    fix = off_policy_correction("none", OLD, ROLLOUT, MASK)
    close(fix.weights, torch.ones(2, 3))
    close(fix.keep, MASK)
    with pytest.raises(ValueError, match="unknown off-policy correction"):
        off_policy_correction("tis-ish", OLD, ROLLOUT, MASK)
    with pytest.raises(ValueError, match="low <= 1 <= high"):
        off_policy_correction("icepop", OLD, ROLLOUT, MASK, low=1.2, high=2.0)


def test_mismatch_metrics_by_hand():
    fix = off_policy_correction("icepop", OLD, ROLLOUT, MASK, low=0.5, high=1.5)
    got = mismatch_metrics(OLD, ROLLOUT, MASK, fix)
    # k3 = r - 1 - log r: e^.5 - 1.5 = 0.148721, e^-1 = 0.367879, 0, e - 2 = 0.718282 twice
    k3 = [math.exp(0.5) - 1.5, math.exp(-1.0), 0.0, E - 2, E - 2]
    ratios = [math.exp(0.5), math.exp(-1.0), 1.0, E, E]
    assert got["mismatch/kl_k3"] == pytest.approx(sum(k3) / 5)
    assert got["mismatch/is_ratio_mean"] == pytest.approx(sum(ratios) / 5)
    assert got["mismatch/is_ratio_max"] == pytest.approx(E)
    assert got["mismatch/dropped_fraction"] == pytest.approx(4 / 5)
    assert all(v == 0.0 for v in mismatch_metrics(OLD, ROLLOUT, torch.zeros_like(MASK), fix).values())


@pytest.mark.parametrize(("kind", "loss", "grad"), [
    # token-mean over 3 tokens, A = +1, ratio pi/pi_old = 1: loss = -sum(w * keep) / 3, dloss/dlp = -w * keep / 3
    ("tis", -(1.5 + 1 / E + 1.0) / 3, [-0.5, -1 / (3 * E), -1 / 3]),
    ("icepop", -1 / 3, [0.0, 0.0, -1 / 3]),
    ("token_mask", -1 / 3, [0.0, 0.0, -1 / 3]),
    ("none", -1.0, [-1 / 3] * 3),
])
def test_the_rank_applies_the_correction_to_the_policy_gradient(rank_loss, kind, loss, grad):  # noqa: F811
    rl_fns, get = rank_loss
    loss_fn = get(rl_fns.train_policy, "token-mean", off_policy_correction=kind, is_cap=1.5, is_low=0.5, is_high=1.5)
    lp = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    mb = micro(mask=torch.ones(1, 3), advantages=torch.ones(1, 3), old_logprobs=lp.detach().clone(),
               rollout_logprobs=torch.tensor([[-1.5, -1.0, -0.5]]), denom=3.0)
    result = loss_fn({"lp": lp, "ent": torch.zeros(1, 3)}, mb)
    total, out = result.loss, result.metrics
    close(out["pg_loss"], loss, atol=1e-6)
    total.backward()
    close(lp.grad, [grad], atol=1e-6)
