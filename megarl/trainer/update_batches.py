"""What the update rank functions receive: the step's batch with its advantages and normalisers."""

from __future__ import annotations

import torch

from megarl.algorithms.base import Estimate
from megarl.config.schema import RunConfig
from megarl.rollout_driver.batch import RolloutBatch
from megarl.workers.rank_batch import RankBatch
from megarl.workers.rank_results import TokenStats


def policy_batch(batch: RolloutBatch, est: Estimate, old: TokenStats | None,
                 ref: torch.Tensor | None, cfg: RunConfig) -> RankBatch:
    """The actor's update batch. Without ``old`` the update is on-policy and returns log-probs and
    entropy at every response token (``select_mask``) for the step's metrics."""
    return RankBatch(
        tokens=batch.tokens, seq_lens=batch.seq_lens, mask=est.mask, temperature=batch.temperature,
        advantages=est.advantages, old_logprobs=None if old is None else old.logprobs,
        select_mask=batch.mask if old is None else None, ref_logprobs=ref,
        rollout_logprobs=batch.rollout_logprobs if cfg.algorithm.off_policy_correction != "none" else None,
        routes=batch.routes,
        **denominators(est.mask, cfg, cfg.actor.parallel.data_parallel_size))


def value_batch(batch: RolloutBatch, est: Estimate, values: torch.Tensor, cfg: RunConfig) -> RankBatch:
    """The critic's update batch: its values before the update and the returns it moves towards."""
    return RankBatch(tokens=batch.tokens, seq_lens=batch.seq_lens, mask=est.mask, old_values=values,
                     returns=est.returns, **denominators(est.mask, cfg, cfg.critic.parallel.data_parallel_size))


def denominators(mask: torch.Tensor, cfg: RunConfig, dp: int) -> dict:
    """The loss normalisers the ranks pass to ``aggregate``: ``denoms``, each minibatch's global
    normaliser (its response tokens for "token-mean", else its sequences with a response token),
    and ``norm_len``, the constant per-sequence divisor of "seq-mean-token-sum" (Dr.GRPO: the
    generation budget ``rollout.max_tokens``; None for the other modes, which do not use it).
    Ranks split the batch over data-parallel shards first, then each shard into minibatches:
    minibatch m is the m-th slice of every shard."""
    aggregation = cfg.algorithm.aggregation
    minibatches = cfg.algorithm.minibatches
    out = []
    for m in range(minibatches):
        part = torch.cat([shard.chunk(minibatches)[m] for shard in mask.chunk(dp)]) != 0
        count = part.sum() if aggregation == "token-mean" else part.any(dim=1).sum()
        out.append(max(float(count), 1.0))
    norm_len = float(cfg.rollout.max_tokens) if aggregation == "seq-mean-token-sum" else None
    return {"denoms": out, "norm_len": norm_len}
