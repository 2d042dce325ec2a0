"""The typed batch the ranks receive and the typed results they send back, without a model."""

from __future__ import annotations

from dataclasses import fields

import pytest
import torch

from megarl.workers.microbatches import MicroBatch
from megarl.workers.rank_batch import SEQUENCE_FIELDS, RankBatch
from megarl.workers.rank_results import ShardResult, TokenStats, gather_shards


def _batch(rows: int = 4) -> RankBatch:
    return RankBatch(tokens=torch.arange(rows * 5).view(rows, 5), mask=torch.ones(rows, 4),
                     advantages=torch.arange(rows, dtype=torch.float), temperature=0.5, denoms=[3.0, 4.0],
                     kto_kl=0.25)


def test_a_shard_and_a_minibatch_cut_every_per_row_tensor_and_keep_the_rest():
    batch = _batch()
    shard = batch.shard(dp=2, rank=1)
    assert torch.equal(shard.tokens, batch.tokens[2:]) and torch.equal(shard.mask, batch.mask[2:])
    assert torch.equal(shard.advantages, batch.advantages[2:]) and shard.seq_lens is None
    assert (shard.temperature, shard.denoms, shard.kto_kl) == (0.5, [3.0, 4.0], 0.25)
    part = shard.rows(1, 2)
    assert torch.equal(part.tokens, batch.tokens[3:4]) and part.size == 1 and part.denoms == [3.0, 4.0]
    with pytest.raises(ValueError, match="4 sequences does not split over 3"):
        batch.shard(dp=3, rank=0)


def test_every_per_sequence_field_of_the_batch_reaches_the_micro_batches():
    micro = {f.name for f in fields(MicroBatch)}
    assert set(SEQUENCE_FIELDS) <= micro
    # every tensor field but the tokens and routes (the micro-batch's rows and their model input)
    tensors = {f.name for f in fields(RankBatch) if "Tensor" in str(f.type)}
    assert set(SEQUENCE_FIELDS) == tensors - {"tokens", "routes"}


def test_shards_are_put_together_in_data_parallel_order():
    results = [ShardResult(1, TokenStats(torch.ones(1, 2), torch.full((1, 2), 3.0))), None,
               ShardResult(0, TokenStats(torch.zeros(1, 2), torch.full((1, 2), 2.0)))]
    stats = gather_shards(results)
    assert torch.equal(stats.logprobs, torch.tensor([[0.0, 0.0], [1.0, 1.0]]))
    assert torch.equal(stats.entropy, torch.tensor([[2.0, 2.0], [3.0, 3.0]]))
    scores = gather_shards([ShardResult(1, torch.tensor([5.0])), ShardResult(0, torch.tensor([4.0]))])
    assert torch.equal(scores, torch.tensor([4.0, 5.0]))
