"""GSPO against numbers worked out by hand: the sequence ratio, its clip, the loss and its gradient.

Four sequences (float64): row 0 has 2 valid tokens, rows 1 and 2 have 3, row 3 none; padding holds
garbage (NaN advantages, huge log-probs) that must reach neither the loss nor a gradient. Log-ratios
log pi - log pi_old per valid token:

    row 0: 1e-4, 3e-4          mean 2e-4  -> s0 = e^2e-4  (inside [1 - 3e-4, 1 + 4e-4])
    row 1: 1e-3, 1e-3, 1e-3    mean 1e-3  -> s1 = e^1e-3  (above 1 + 4e-4)
    row 2: 2e-3, -1e-3, 2e-3   mean 1e-3  -> s2 = e^1e-3

Advantages A = 1, 0.5, -1 (row 3: 0). Per sequence l = max(-A s, -A clip(s)):
    l0 = -s0 (unclipped), l1 = -0.5 * 1.0004 (clipped: no gradient), l2 = s2 (A < 0: the unclipped
    branch is the larger one). Row 2's middle token alone has ratio e^-1e-3 < 1 - 3e-4, which a
    token-level PPO with A < 0 would clip to zero gradient; GSPO keeps it, like its other tokens.
"""

from __future__ import annotations

import math

import pytest
import torch
from test_algorithm_edges import close, micro, rank_loss  # noqa: F401 (rank_loss is a fixture)

from megarl.algorithms import get_algorithm
from megarl.algorithms.base import PolicyMicroBatch, ScoredBatch
from megarl.config.schema import AlgorithmConfig

F64 = torch.float64
NAN = float("nan")
MASK = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 1, 1], [0, 0, 0]], dtype=F64)
OLD = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, -1.5, -1.0], [-2.0, -0.3, -0.7], [0.0, 0.0, 0.0]], dtype=F64)
DELTA = torch.tensor([[1e-4, 3e-4, 50.0], [1e-3, 1e-3, 1e-3], [2e-3, -1e-3, 2e-3], [70.0, 70.0, 70.0]], dtype=F64)
A = torch.tensor([1.0, 0.5, -1.0, 0.0], dtype=F64)
S0, S12 = math.exp(2e-4), math.exp(1e-3)


def micro_batch(advantages: torch.Tensor, denom: float) -> PolicyMicroBatch:
    lp = (OLD + DELTA).requires_grad_()
    return PolicyMicroBatch(logprobs=lp, old_logprobs=OLD.clone(), advantages=advantages, mask=MASK, denom=denom)


def test_gspo_defaults_are_the_papers():
    cfg = AlgorithmConfig(name="gspo")
    assert (cfg.clip_low, cfg.clip_high, cfg.aggregation) == (3e-4, 4e-4, "seq-mean-token-mean")
    assert AlgorithmConfig(name="gspo", clip_high=1e-3).clip_high == 1e-3  # a given value wins


@pytest.mark.parametrize("per_token", [False, True], ids=["A[b]", "A[b,T]"])
def test_sequence_mean_loss_and_gradient_by_hand(per_token):
    cfg = AlgorithmConfig(name="gspo")
    # as the driver sends them: broadcast on the valid tokens, here NaN on padding
    adv = torch.where(MASK.bool(), A[:, None].expand(4, 3), NAN) if per_token else A
    mb = micro_batch(adv, denom=3.0)  # three sequences with tokens
    loss, metrics = get_algorithm("gspo").policy_loss(cfg, mb)
    l0, l1, l2 = -S0, -0.5 * (1 + 4e-4), S12
    close(loss, (l0 + l1 + l2) / 3, atol=1e-12)
    loss.backward()
    # d l0 / d lp_t = -s0 / 2 (row 0: 2 tokens), d l2 / d lp_t = s2 / 3, each divided by the 3 sequences
    close(mb.logprobs.grad, [[-S0 / 6, -S0 / 6, 0.0], [0.0, 0.0, 0.0], [S12 / 9] * 3, [0.0] * 3], atol=1e-12)
    close(metrics["clip_fraction"], 1 / 3)  # row 1 of the 3 sequences
    close(metrics["ratio_mean"], (S0 + 2 * S12) / 3, atol=1e-12)


def test_token_mean_weighs_sequences_by_length():
    cfg = AlgorithmConfig(name="gspo", aggregation="token-mean")
    mb = micro_batch(A, denom=8.0)  # 2 + 3 + 3 valid tokens
    loss, _ = get_algorithm("gspo").policy_loss(cfg, mb)
    close(loss, (2 * -S0 + 3 * -0.5 * (1 + 4e-4) + 3 * S12) / 8, atol=1e-12)
    loss.backward()
    # row 0: (2 / 8) * (-s0 / 2) per token; row 2: (3 / 8) * (s2 / 3)
    close(mb.logprobs.grad, [[-S0 / 8, -S0 / 8, 0.0], [0.0] * 3, [S12 / 8] * 3, [0.0] * 3], atol=1e-12)


def test_gspo_advantages_are_grpos():
    scores, mask = torch.tensor([1.0, 0.0, 0.0, 1.0]), torch.ones(4, 2)
    gspo = get_algorithm("gspo").estimate(AlgorithmConfig(name="gspo"), ScoredBatch(scores, mask, 2))
    grpo = get_algorithm("grpo").estimate(AlgorithmConfig(name="grpo"), ScoredBatch(scores, mask, 2))
    assert torch.equal(gspo.advantages, grpo.advantages)


def test_gspo_refuses_token_level_settings():
    errors = get_algorithm("gspo").errors
    assert errors(AlgorithmConfig(name="gspo")) == []
    got = errors(AlgorithmConfig(name="gspo", dual_clip=3.0, off_policy_correction="tis",
                                 aggregation="seq-mean-token-sum"))
    assert [e.split(":")[0] for e in got] == [
        "algorithm.dual_clip=3.0", "algorithm.aggregation='seq-mean-token-sum'",
        "algorithm.off_policy_correction='tis' weighs single tokens, gspo weighs whole sequences; "
        "use seq_tis, mis or token_mask"]


def test_the_rank_runs_gspo_from_the_config(rank_loss):  # noqa: F811
    rl_fns, get = rank_loss
    loss_fn = get(rl_fns.train_policy, "seq-mean-token-mean", name="gspo")
    lp = (OLD + DELTA).float().requires_grad_()
    mb = micro(mask=MASK.float(), advantages=A.float()[:, None] * MASK.float(), old_logprobs=OLD.float(), denom=3.0)
    result = loss_fn({"lp": lp, "ent": torch.zeros(4, 3)}, mb)
    total, out = result.loss, result.metrics
    close(out["pg_loss"], (-S0 - 0.5 * (1 + 4e-4) + S12) / 3, atol=1e-6)
    close(out["clip_fraction"], 1 / 3, atol=1e-6)  # the share of this micro-batch is 3 / 3
    total.backward()
    close(lp.grad, [[-S0 / 6, -S0 / 6, 0.0], [0.0] * 3, [S12 / 9] * 3, [0.0] * 3], atol=1e-6)
