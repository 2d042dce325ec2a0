"""Adversarial inputs for megarl.algorithms and the trainer's use of its normalisers (issue 11, item 2).

Expected numbers are literals worked out by hand in the comments. The cases: groups of equal
scores (exactly 0 advantage in every dtype, also when the scores are weighted sums of reward
terms), non-finite values at masked positions (finite values *and* gradients), empty rows and
batches, and the Dr.GRPO length normaliser on its way from the driver to the ranks' losses.
"""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import pytest
import torch

from megarl.algorithms import (
    aggregate,
    broadcast,
    dynamic_sampling_mask,
    entropy_loss,
    gae,
    grpo_advantages,
    kl_loss,
    masked_var,
    policy_loss,
    reinforce_pp_advantages,
    rloo_advantages,
    token_rewards,
    value_loss,
    whiten,
)
from megarl.config.schema import AlgorithmConfig, OptimizerConfig, RolloutConfig
from megarl.workers.microbatches import MicroBatch
from megarl.workers.rank_batch import RankBatch

F64 = torch.float64
NAN, INF = float("nan"), float("inf")


def close(actual: torch.Tensor, expected, atol: float = 1e-6) -> None:
    torch.testing.assert_close(actual.detach().to(F64), torch.as_tensor(expected, dtype=F64), atol=atol, rtol=0)


def exactly_zero(x: torch.Tensor) -> bool:
    return bool(torch.equal(x, torch.zeros_like(x)))


# ---------------------------------------------------------------- groups of equal scores

@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
@pytest.mark.parametrize("group_size", [3, 6, 7, 8, 16])
def test_equal_scores_give_exactly_zero_advantage(dtype, group_size):
    # Before: fp32 groups of 7/8/16 scores of 0.7 got 0.056 each from GRPO (a 6e-8 error of the
    # mean over std 0 + eps 1e-6), RLOO and Dr.GRPO 6e-8; fp64 GRPO 1.1e-10 at sizes 3, 6, 7.
    scores = torch.full((2 * group_size,), 0.7, dtype=dtype)
    for adv in (grpo_advantages(scores, group_size), grpo_advantages(scores, group_size, norm_std=False),
                rloo_advantages(scores, group_size)):
        assert adv.dtype == dtype
        assert exactly_zero(adv), adv


def test_weighted_reward_terms_equal_group_is_zero_mixed_group_is_signed():
    # Three reward terms (format, correctness, length) with weights 0.2, 0.5, 0.3, summed in fp32
    # as the trainer combines them. Group 0: eight correct answers, 0.2 + 0.5 = 0.7 each.
    # Group 1: four correct (0.7) and four wrong (0.2): mean 0.45, deviations +-0.25,
    # unbiased std sqrt(8 * 0.0625 / 7) = 0.2672612, A = +-0.25 / (0.2672612 + 1e-6) = +-0.9354108.
    weights = torch.tensor([0.2, 0.5, 0.3])
    correct, wrong = [1.0, 1.0, 0.0], [1.0, 0.0, 0.0]
    terms = torch.tensor([correct] * 8 + [correct, wrong] * 4)
    scores = (terms * weights).sum(dim=1)
    assert scores.dtype == torch.float32
    adv = grpo_advantages(scores, 8)
    assert exactly_zero(adv[:8])  # before: 0.056 each, pushing these correct answers
    close(adv[8:], [0.9354108, -0.9354108] * 4, atol=1e-5)
    # Dr.GRPO (mean only): +-0.25; RLOO: 8/7 * +-0.25 = +-0.2857143
    drgrpo = grpo_advantages(scores, 8, norm_std=False)
    assert exactly_zero(drgrpo[:8])
    close(drgrpo[8:], [0.25, -0.25] * 4, atol=1e-6)
    rloo = rloo_advantages(scores, 8)
    assert exactly_zero(rloo[:8])
    close(rloo[8:], [0.2857143, -0.2857143] * 4, atol=1e-6)


def test_constant_values_whiten_to_exactly_zero():
    # 0.1 at every valid token (rows of 5, 3, 5, 1 tokens, garbage padding), fp32.
    # Before: whiten gave -7.5e-5 (rounding of the mean over sqrt(var 6e-17 + 1e-8)), masked_var 6e-17.
    mask = torch.arange(5)[None, :] < torch.tensor([5, 3, 5, 1])[:, None]
    x = torch.where(mask, torch.tensor(0.1), torch.tensor(NAN))
    assert exactly_zero(masked_var(x, mask))
    assert exactly_zero(whiten(x, mask))
    # only the scale changes with shift_mean=False: constant valid values stay as they are
    assert torch.equal(whiten(x, mask, shift_mean=False), torch.where(mask, x, 0.0))
    # no valid element, or no element at all: 0
    assert exactly_zero(whiten(x, torch.zeros_like(mask))) and exactly_zero(masked_var(x, torch.zeros_like(mask)))
    assert whiten(torch.zeros(2, 0), torch.zeros(2, 0)).shape == (2, 0)
    assert exactly_zero(masked_var(torch.zeros(2, 0), torch.zeros(2, 0)))
    # REINFORCE++: every sequence scores 0.7, gamma 1, so every return-to-go is 0.7 -> advantage 0
    # (before: 6e-4 at each token)
    rewards = token_rewards(torch.full((4,), 0.7), mask)
    assert exactly_zero(reinforce_pp_advantages(rewards, mask))


def test_explained_variance_of_constant_returns_is_zero():
    # fp32 returns all 0.7 have no variance: explained variance 0 as documented
    # (before: a rounding variance of 4e-15 made it 1 - 0.0525 / 4e-15 = -1.5e13)
    values = torch.tensor([[0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 0.4, 0.3]])
    _, metrics = value_loss(values, values, torch.full((1, 8), 0.7), torch.ones(1, 8))
    assert metrics["explained_variance"].item() == 0.0


def test_dynamic_sampling_accepts_pass_fail_scores():
    # groups [pass, pass] (no signal, dropped) and [fail, pass] (kept); before: bool subtraction error
    keep, kept = dynamic_sampling_mask(torch.tensor([True, True, False, True]), 2)
    assert keep.tolist() == [False, False, True, True] and kept == 1


def test_scores_must_be_finite():
    # before: a NaN score turned its whole group into NaN advantages (inf: NaN and -inf), silently
    for bad in (NAN, INF, -INF):
        scores = torch.tensor([bad, 1.0, 0.0, 1.0])
        with pytest.raises(ValueError, match="finite"):
            grpo_advantages(scores, 2)
        with pytest.raises(ValueError, match="finite"):
            grpo_advantages(scores, 2, norm_std=False)
        with pytest.raises(ValueError, match="finite"):
            rloo_advantages(scores, 2)


def test_group_edge_sizes():
    # a group of one is its own baseline: 0
    assert exactly_zero(grpo_advantages(torch.tensor([0.3, 0.9]), 1))
    # an empty batch gives an empty result, without torch.std's degrees-of-freedom warning (before)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert grpo_advantages(torch.zeros(0), 4).shape == (0,)
        assert rloo_advantages(torch.zeros(0), 4).shape == (0,)
    # two samples [0, 1]: mean 0.5, unbiased std sqrt(0.5) = 0.7071068 -> +-0.5 / 0.7071078 = +-0.7071058
    close(grpo_advantages(torch.tensor([0.0, 1.0], dtype=F64), 2), [-0.7071058, 0.7071058])
    with pytest.raises(ValueError, match="groups of 3"):
        grpo_advantages(torch.zeros(4), 3)
    with pytest.raises(ValueError, match="groups of 3"):
        rloo_advantages(torch.zeros(4), 3)
    with pytest.raises(ValueError, match="groups of 0"):
        grpo_advantages(torch.zeros(4), 0)


# ---------------------------------------------------------------- non-finite values at masked positions

MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])


def test_value_loss_nonfinite_padding_has_finite_gradient():
    # Valid tokens (old, v, R): t1 (0.5, 1.0, 1.0), t2 (0.5, 0.6, 1.0), t3 (0.0, -0.5, 1.0); padding NaN/inf.
    # clip 0.2: t1 v_clip 0.7 -> 0.5 * max(0, 0.09) = 0.045 (clipped, gradient 0); t2 0.5 * 0.16 = 0.08;
    # t3 v_clip -0.2 -> 0.5 * max(2.25, 1.44) = 1.125; token-mean 1.25 / 3 = 0.4166667.
    # gradient (v - R) / 3 on the unclipped ones: t2 -0.4 / 3 = -0.1333333, t3 -1.5 / 3 = -0.5.
    # Before: NaN gradient at the padding (the square's backward multiplies 0 by NaN).
    old = torch.tensor([[0.5, 0.5, INF], [0.0, NAN, NAN]], dtype=F64)
    values = torch.tensor([[1.0, 0.6, NAN], [-0.5, INF, -INF]], dtype=F64, requires_grad=True)
    returns = torch.tensor([[1.0, 1.0, NAN], [1.0, -INF, INF]], dtype=F64)
    loss, metrics = value_loss(values, old, returns, MASK, clip=0.2)
    close(loss, 0.4166667)
    loss.backward()
    close(values.grad, [[0.0, -0.1333333, 0.0], [-0.5, 0.0, 0.0]])
    close(metrics["clip_fraction"], 1 / 3)
    close(metrics["value_mean"], 0.3666667)  # (1.0 + 0.6 - 0.5) / 3
    close(metrics["explained_variance"], 0.0)  # returns all 1: no variance to explain
    # unclipped: 0.5 * (0 + 0.16 + 2.25) / 3 = 0.4016667; gradient (v - R) / 3 = [0, -0.1333333], [-0.5]
    values.grad = None
    loss, _ = value_loss(values, old, returns, MASK)
    close(loss, 0.4016667)
    loss.backward()
    close(values.grad, [[0.0, -0.1333333, 0.0], [-0.5, 0.0, 0.0]])


def test_masked_var_and_whiten_nonfinite_padding_have_finite_gradients():
    # valid 1, 2, 3, 4: mean 2.5, d var / d x = 2 (x - 2.5) / 3 = [-1, -1/3, 1/3], [1]
    # Before: NaN everywhere (the padding's NaN reached the mean's gradient).
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, NAN, INF]], dtype=F64, requires_grad=True)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    masked_var(x, mask).backward()
    close(x.grad, [[-1.0, -1 / 3, 1 / 3], [1.0, 0.0, 0.0]])
    x.grad = None
    w = whiten(x, mask)
    w[0, 0].backward()  # depends on every valid element, on no padding one
    assert torch.isfinite(x.grad).all()
    assert torch.equal(x.grad[1, 1:], torch.zeros(2, dtype=F64))


def _with_padding(t: torch.Tensor, fill: float) -> torch.Tensor:
    return torch.where(MASK.bool(), t, torch.tensor(fill, dtype=t.dtype))


LOSSES = {
    "policy": lambda lp, other, extra: policy_loss(lp, other, extra, MASK)[0],
    "policy-dual-clip": lambda lp, other, extra: policy_loss(lp, other, extra, MASK, dual_clip=3.0)[0],
    "policy-seq-sum": lambda lp, other, extra: policy_loss(lp, other, extra, MASK, aggregation="seq-mean-token-sum",
                                                           norm_len=4)[0],
    "value": lambda lp, other, extra: value_loss(lp, other, extra, MASK)[0],
    "value-clip": lambda lp, other, extra: value_loss(lp, other, extra, MASK, clip=0.2)[0],
    "kl-k1": lambda lp, other, extra: kl_loss(lp, other, MASK, "k1"),
    "kl-k2": lambda lp, other, extra: kl_loss(lp, other, MASK, "k2"),
    "kl-k3": lambda lp, other, extra: kl_loss(lp, other, MASK, "k3", clamp=10.0),
    "entropy": lambda lp, other, extra: entropy_loss(lp, MASK, "seq-mean-token-mean"),
    "aggregate-token-mean": lambda lp, other, extra: aggregate(lp, MASK, "token-mean"),
    "aggregate-seq-sum": lambda lp, other, extra: aggregate(lp, MASK, "seq-mean-token-sum", norm_len=3),
    "masked_var": lambda lp, other, extra: masked_var(lp, MASK),
    "whiten": lambda lp, other, extra: (whiten(lp, MASK) * torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])).sum(),
}


@pytest.mark.parametrize("name", list(LOSSES))
@pytest.mark.parametrize("fill", [NAN, INF, -INF, 1e30])
def test_nonfinite_padding_changes_no_value_and_no_gradient(name, fill):
    # Each loss with garbage at the padding of all its inputs equals the same loss with 0 there,
    # in value and in gradient (the hand-computed values of each are in test_algorithms.py).
    lp = torch.tensor([[-0.5, -1.2, 0.0], [-0.3, 0.0, 0.0]])
    other = torch.tensor([[-0.7, -1.0, 0.0], [-0.4, 0.0, 0.0]])
    extra = torch.tensor([[1.0, -1.0, 0.0], [-2.0, 0.0, 0.0]])
    results = []
    for pad in (0.0, fill):
        x = _with_padding(lp, pad).requires_grad_()
        loss = LOSSES[name](x, _with_padding(other, pad), _with_padding(extra, pad))
        loss.backward()
        results.append((loss.detach(), x.grad))
    (clean, clean_grad), (dirty, dirty_grad) = results
    assert torch.isfinite(dirty) and torch.isfinite(dirty_grad).all(), (dirty, dirty_grad)
    torch.testing.assert_close(dirty, clean)
    torch.testing.assert_close(dirty_grad, clean_grad)
    assert torch.equal(dirty_grad[~MASK.bool()], torch.zeros(3))


# ---------------------------------------------------------------- empty rows and batches

def test_policy_loss_empty_batch_metrics_are_zero():
    # no valid token: loss 0, zero gradient, every metric 0 (before: ratio_max was -inf)
    logp = torch.tensor([[3.0, NAN]], requires_grad=True)
    loss, metrics = policy_loss(logp, torch.zeros(1, 2), torch.tensor([1.0]), torch.zeros(1, 2))
    loss.backward()
    assert loss.item() == 0.0 and torch.equal(logp.grad, torch.zeros(1, 2))
    assert {k: v.item() for k, v in metrics.items()} == {
        "clip_fraction": 0.0, "dual_clip_fraction": 0.0, "approx_kl": 0.0, "ratio_mean": 0.0, "ratio_max": 0.0}


def test_zero_length_response_contributes_nothing():
    # row 0: 2 tokens, score 1; row 1: a zero-length response (no valid token) with a NaN advantage
    mask = torch.tensor([[1, 1, 0], [0, 0, 0]])
    assert torch.equal(token_rewards(torch.tensor([1.0, 5.0]), mask), torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 0.0]]))
    adv, ret = gae(torch.tensor([[0.0, 1.0, 9.0], [9.0, 9.0, 9.0]]), torch.full((2, 3), 0.5), mask)
    close(adv, [[0.5, 0.5, 0.0], [0.0, 0.0, 0.0]])  # gamma = lam = 1: A1 = 1 - 0.5, A0 = 0 + 0.5 - 0.5 + 0.5
    close(ret, [[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    close(broadcast(torch.tensor([2.0, NAN]), mask), [[2.0, 2.0, 0.0], [0.0, 0.0, 0.0]])
    # ratio 1: loss tokens -A = -1 on row 0. seq-mean-token-sum over the one sequence with tokens,
    # norm_len 4: -2 / 4 = -0.5; gradient -A r / (4 * 1) = -0.25 on row 0's tokens
    logp = torch.zeros(2, 3, requires_grad=True)
    loss, _ = policy_loss(logp, torch.zeros(2, 3), torch.tensor([1.0, NAN]), mask,
                          aggregation="seq-mean-token-sum", norm_len=4)
    close(loss, -0.5)
    loss.backward()
    close(logp.grad, [[-0.25, -0.25, 0.0], [0.0, 0.0, 0.0]])


# ---------------------------------------------------------------- Dr.GRPO's length normaliser in the trainer

def _cfg(aggregation: str, minibatches: int = 1, max_tokens: int = 8):
    return SimpleNamespace(algorithm=AlgorithmConfig(aggregation=aggregation, minibatches=minibatches),
                           rollout=RolloutConfig(max_tokens=max_tokens))


# rows of 3, 0, 1 and 5 response tokens
MASK4 = (torch.arange(5)[None, :] < torch.tensor([3, 0, 1, 5])[:, None]).float()


def test_denominators_carry_the_dr_grpo_length_normaliser():
    from megarl.trainer.update_batches import denominators

    # dp 2, one minibatch: 9 tokens, 3 sequences with tokens; norm_len = rollout.max_tokens = 8
    # (before: no norm_len at all, so the ranks divided each sequence's token sum by 1)
    assert denominators(MASK4, _cfg("seq-mean-token-sum"), 2) == {"denoms": [3.0], "norm_len": 8.0}
    assert denominators(MASK4, _cfg("seq-mean-token-mean"), 2) == {"denoms": [3.0], "norm_len": None}
    assert denominators(MASK4, _cfg("token-mean"), 2) == {"denoms": [9.0], "norm_len": None}
    # dp 2, two minibatches: shards rows {0, 1} and {2, 3}; minibatch 0 = rows 0, 2 (4 tokens,
    # 2 sequences), minibatch 1 = rows 1, 3 (5 tokens, 1 sequence)
    assert denominators(MASK4, _cfg("seq-mean-token-sum", 2), 2) == {"denoms": [2.0, 1.0], "norm_len": 8.0}
    assert denominators(MASK4, _cfg("token-mean", 2), 2) == {"denoms": [4.0, 5.0], "norm_len": None}


def test_dr_grpo_shards_sum_to_the_documented_aggregate():
    from megarl.trainer.update_batches import denominators

    # loss 1 on every token: sequence sums 3, 0, 1, 5. Documented "seq-mean-token-sum":
    # mean over the 3 sequences with tokens of (sum / norm_len 8) = (3 + 1 + 5) / 8 / 3 = 0.375
    loss = torch.ones(4, 5)
    norms = denominators(MASK4, _cfg("seq-mean-token-sum"), 2)
    total = sum(aggregate(lt, m, "seq-mean-token-sum", norm_len=norms["norm_len"], denom=norms["denoms"][0])
                for lt, m in zip(loss.chunk(2), MASK4.chunk(2), strict=True))
    close(total, 0.375)


@pytest.fixture
def rank_loss(monkeypatch):
    """The loss function a rank's update runs, without Megatron: ``run_update`` hands it back instead
    of training, and the model's output stands for the per-token outputs read from it: the policy's
    log-probs and entropy (``{"lp": [b, T], "ent": [b, T]}``), the critic's values (``[b, T + 1, 1]``)."""
    import megarl.models.forward as forward
    from megarl.workers import rl_fns

    monkeypatch.setattr(rl_fns, "held", lambda key: SimpleNamespace(spec=SimpleNamespace(arch=SimpleNamespace(
        vocab_size=10))))
    monkeypatch.setattr(rl_fns, "run_update", lambda *args, **kwargs: args[6])  # the loss_fn argument
    monkeypatch.setattr(forward, "rows_output", lambda output, inputs: output)
    monkeypatch.setattr(rl_fns, "label_stats",
                        lambda out, mb, vocab, entropy=False: (out["lp"], out["ent"]) if entropy else out["lp"])
    monkeypatch.setattr(rl_fns, "positions", lambda output, mb: output)
    monkeypatch.setattr(rl_fns, "per_label", lambda x, mb: x)

    def get(fn, aggregation: str, **algo):
        # with old log-probs: an off-policy update, whose loss reads the micro-batch's
        batch = RankBatch(tokens=torch.zeros(1, 2, dtype=torch.long), mask=torch.ones(1, 1),
                          old_logprobs=torch.zeros(1, 1))
        return fn("actor", batch, AlgorithmConfig(aggregation=aggregation, **algo), OptimizerConfig(),
                  micro_batch_size=1)

    return rl_fns, get


def micro(**fields) -> MicroBatch:
    """A micro-batch of these per-sequence fields, without rows (``rank_loss``'s model reads none)."""
    return MicroBatch(plan=None, tokens=None, inputs=None, index=None, gather=None, valid=None, seq_row=None,
                      seq_start=None, **fields)


def test_rank_policy_loss_uses_the_dr_grpo_length_normaliser(rank_loss):
    rl_fns, get = rank_loss
    loss_fn = get(rl_fns.train_policy, "seq-mean-token-sum", kl_coef=0.5, kl_estimator="k1", entropy_coef=0.1)
    # row 0: A = +1 on 3 tokens; row 1: A = -1 on 1 token; row 2: dropped (no token). Ratio 1.
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    lp = torch.tensor([[-1.0, -2.0, -0.5], [-0.7, 0.0, 0.0], [0.0, 0.0, 0.0]], requires_grad=True)
    mb = micro(mask=mask, advantages=torch.tensor([[1.0] * 3, [-1.0] * 3, [0.0] * 3]) * mask,
               old_logprobs=lp.detach().clone(), ref_logprobs=(lp - 0.2).detach() * mask,
               denom=2.0, norm_len=4.0)  # as denominators() gives with rollout.max_tokens 4
    result = loss_fn({"lp": lp, "ent": torch.full((3, 3), 0.5) * mask}, mb)
    loss, out = result.loss, result.metrics
    # pg: sequence sums -3 and +1, (-3/4 + 1/4) / 2 = -0.25 (before: (-3 + 1) / 2 = -1.0)
    # kl k1 = 0.2 a token: (0.6/4 + 0.2/4) / 2 = 0.1; entropy 0.5 a token: (1.5/4 + 0.5/4) / 2 = 0.25
    # loss = -0.25 + 0.5 * 0.1 - 0.1 * 0.25 = -0.225
    close(out["pg_loss"], -0.25)
    close(out["kl_loss"], 0.1)
    close(out["entropy"], 0.25)
    close(loss, -0.225)
    # d/d lp: pg -A / (4 * 2) = -0.125 (row 0), +0.125 (row 1); kl 0.5 / 8 = 0.0625
    loss.backward()
    close(lp.grad, [[-0.0625] * 3, [0.1875, 0.0, 0.0], [0.0] * 3])


def test_rank_value_loss_uses_the_dr_grpo_length_normaliser(rank_loss):
    rl_fns, get = rank_loss
    loss_fn = get(rl_fns.train_value, "seq-mean-token-sum", value_clip=None)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    values = torch.tensor([[1.0, 1.0, 1.0], [2.0, NAN, NAN]], requires_grad=True)
    mb = micro(mask=mask, old_values=torch.zeros(2, 3), returns=torch.zeros(2, 3), denom=2.0, norm_len=4.0)
    # the value head's output [b, T + 1, 1]: the values before each label position, and one after the last
    result = loss_fn(torch.nn.functional.pad(values, (0, 1)).unsqueeze(-1), mb)
    loss, out = result.loss, result.metrics
    # 0.5 (V - R)^2: row 0 three tokens of 0.5 (sum 1.5), row 1 one of 2.0:
    # (1.5/4 + 2.0/4) / 2 = 0.4375 (before: (1.5 + 2.0) / 2 = 1.75)
    close(loss, 0.4375)
    close(out["value_loss"], 0.4375)
    loss.backward()
    close(values.grad, [[0.125] * 3, [0.25, 0.0, 0.0]])  # (V - R) / (4 * 2)
