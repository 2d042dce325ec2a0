"""Sequence-level truncated importance sampling (seq_tis) against weights worked out by hand.

Log ratios log r = log pi_old - log mu (float64), padding with garbage:

    row 0: -1, 0.3, 1   mean 0.1  ->  w = e^0.1 (1.105) on its 3 tokens
    row 1: -0.2         mean -0.2 ->  w = e^-0.2 (0.819)
    row 2: 2, 1         mean 1.5  ->  e^1.5 = 4.48, capped at 2

With is_floor 0.9 row 1's weight is lifted to 0.9. Nothing is dropped.
"""

from __future__ import annotations

import math

import pytest
import torch

from megarl.algorithms import get_algorithm
from megarl.algorithms.base import PolicyMicroBatch
from megarl.algorithms.off_policy import mismatch_metrics, off_policy_correction
from megarl.algorithms.registry import algorithm_errors
from megarl.algorithms.seq_tis import sequence_tis_weights
from megarl.config.loader import ConfigError, load_config
from megarl.config.schema import AlgorithmConfig, RunConfig

F64 = torch.float64
MASK = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 0, 0]], dtype=F64)
OLD = torch.tensor([[-2.0, -1.0, -0.5, 50.0], [-0.7, 9.0, 9.0, 9.0], [-1.0, -1.0, 7.0, 7.0]], dtype=F64)
MU = torch.tensor([[-1.0, -1.3, -1.5, -80.0], [-0.5, 0.0, 0.0, 0.0], [-3.0, -2.0, 0.0, 0.0]], dtype=F64)
E01, EM02 = math.exp(0.1), math.exp(-0.2)


def close(actual: torch.Tensor, expected, atol: float = 1e-12) -> None:
    torch.testing.assert_close(actual.detach().to(F64), torch.as_tensor(expected, dtype=F64), atol=atol, rtol=0)


def test_each_sequence_weighs_its_truncated_geometric_mean_ratio():
    fix = off_policy_correction("seq_tis", OLD, MU, MASK, cap=2.0)
    close(fix.weights, [[E01, E01, E01, 0.0], [EM02, 0.0, 0.0, 0.0], [2.0, 2.0, 0.0, 0.0]])
    close(fix.keep, MASK)
    assert mismatch_metrics(OLD, MU, MASK, fix)["mismatch/dropped_fraction"] == 0.0


def test_a_floor_lifts_small_sequence_weights():
    fix = off_policy_correction("seq_tis", OLD, MU, MASK, cap=2.0, floor=0.9)
    close(fix.weights, [[E01, E01, E01, 0.0], [0.9, 0.0, 0.0, 0.0], [2.0, 2.0, 0.0, 0.0]])


def test_the_weight_does_not_grow_with_length():
    # every token off by the same ratio e^0.1: weight e^0.1 at any length (the product would be e^0.1 ** n)
    log_r = torch.tensor([[0.1, 0.0, 0.0, 0.0], [0.1, 0.1, 0.1, 0.1], [0.0, 0.0, 0.0, 0.0]], dtype=F64)
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]], dtype=F64)
    close(sequence_tis_weights(log_r, mask, cap=2.0), [[E01, 0, 0, 0], [E01] * 4, [0, 0, 0, 0]])


def test_the_weights_reach_the_policy_gradient():
    # on-policy (ratio 1), token-mean over 6 tokens, advantages 1 | -1 | 0.5: grad -w_i * A_i / 6
    cfg = AlgorithmConfig(name="grpo", off_policy_correction="seq_tis", is_cap=2.0)
    lp = OLD.clone().requires_grad_()
    mb = PolicyMicroBatch(logprobs=lp, old_logprobs=OLD, advantages=torch.tensor([1.0, -1.0, 0.5], dtype=F64),
                          mask=MASK, denom=6.0, rollout_logprobs=MU)
    loss, _ = get_algorithm("grpo").loss(cfg, mb)
    loss.backward()
    close(loss, (-3 * E01 + EM02 - 2 * 2.0 * 0.5) / 6)
    close(lp.grad, [[-E01 / 6] * 3 + [0.0], [EM02 / 6, 0, 0, 0], [-1 / 6, -1 / 6, 0, 0]])


def test_gspo_takes_sequence_weights_and_the_loader_knows_the_kind():
    assert get_algorithm("gspo").errors(AlgorithmConfig(name="gspo", off_policy_correction="seq_tis")) == []
    cfg = load_config(RunConfig, overrides=["algorithm.name=gspo", "algorithm.off_policy_correction=seq_tis",
                                            "algorithm.is_floor=0.5"])
    assert algorithm_errors(cfg) == []
    with pytest.raises(ConfigError, match="seq_tis"):  # the choices named in the refusal
        load_config(RunConfig, overrides=["algorithm.off_policy_correction=seq_tiss"])
