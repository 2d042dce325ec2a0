"""Rank functions of supervised fine-tuning, reward-model training and DPO on a held Megatron model.

They are the RL updates' machinery with another loss: the same data-parallel shards, micro-batches,
optimizer steps, global denominators and metric combination (``megarl.workers.updates``); the losses
are pure functions in ``megarl.algorithms`` (``sft``, ``bradley_terry``, ``dpo``).

Batches are ``RankBatch``es like the RL ones: ``tokens`` [B, L] right-padded, ``mask`` [B, L-1]
over the label positions of completion (assistant) tokens, ``seq_lens`` [B], and ``denoms``: the
step's global normaliser (completion tokens for SFT, pairs for RM and DPO). Preference batches
hold each pair on consecutive rows, chosen first: row 2i is pair i's chosen answer, 2i+1 its
rejected one, so a pair never straddles a micro-batch or a data-parallel shard (micro-batches are
fixed, with an even ``micro_batch_size``). KTO's examples are unpaired: one row each, labelled
by ``desirable`` [B].
"""

from __future__ import annotations

import torch

from megarl.algorithms.base import Metric
from megarl.algorithms.bradley_terry import bradley_terry_loss
from megarl.algorithms.dpo import PairLogprobs, dpo_loss
from megarl.algorithms.kto import kto_loss
from megarl.algorithms.sft import sft_loss
from megarl.config.schema import OptimizerConfig
from megarl.config.supervised import DpoConfig
from megarl.workers.label_stats import label_stats, positions
from megarl.workers.megatron_model import held
from megarl.workers.microbatches import MicroBatch
from megarl.workers.rank_batch import RankBatch
from megarl.workers.rank_results import UpdateResult
from megarl.workers.updates import LossOutput, run_update

SFT_METRICS = (Metric("sft_loss", "sum"),)
RM_METRICS = tuple(Metric(name, "sum") for name in ("rm_loss", "rm/accuracy", "rm/margin", "rm/chosen",
                                                    "rm/rejected"))
DPO_METRICS = tuple(Metric(name, "sum") for name in ("dpo_loss", "dpo/accuracy", "dpo/margin",
                                                     "dpo/reward_chosen", "dpo/reward_rejected"))
KTO_METRICS = (Metric("kto_loss", "sum"), Metric("kto/kl", "same"), Metric("kto/reward_chosen", "sum"),
               Metric("kto/reward_rejected", "sum"))


def _check_pairs(key: str, batch: RankBatch, micro_batch_size: int, max_tokens: int | None,
                 pack: bool) -> None:
    if max_tokens is not None or pack:
        raise ValueError("preference pairs train on fixed micro-batches: max_tokens_per_microbatch and "
                         "pack_sequences would split or reorder pairs")
    dp = held(key).info.dp
    rows = batch.size
    if micro_batch_size % 2 or rows % (2 * dp):
        raise ValueError(f"preference pairs need an even micro_batch_size (got {micro_batch_size}) and an even "
                         f"number of rows per data-parallel rank (got {rows} rows over {dp} ranks)")


def _pair_rows(mb: MicroBatch) -> None:
    index = mb.index
    if not (torch.equal(index[0::2] % 2, torch.zeros_like(index[0::2])) and torch.equal(index[1::2], index[0::2] + 1)):
        raise ValueError("a micro-batch split a preference pair (rows must be chosen, rejected, chosen, ...)")


def train_sft(key: str, batch: RankBatch, algo: None, optim: OptimizerConfig, micro_batch_size: int,
              max_tokens_per_microbatch: int | None = None, pack_sequences: bool = False,
              share_prompt: bool = False) -> UpdateResult | None:
    """One optimizer step of the completion tokens' mean NLL (``megarl.algorithms.sft``); ``algo``
    (no settings) and ``share_prompt`` (a policy-sampling saving) are there for the common call."""
    from megarl.models.forward import rows_output

    vocab = held(key).spec.arch.vocab_size

    def loss_fn(output: torch.Tensor, mb: MicroBatch) -> LossOutput:
        lp = label_stats(rows_output(output, mb.inputs), mb, vocab)
        return LossOutput(*sft_loss(lp, mb.mask, mb.denom))

    return run_update(key, batch, optim, micro_batch_size, 1, 1, loss_fn, max_tokens_per_microbatch,
                      pack_sequences, select=True, metrics=SFT_METRICS)


def train_reward_model(key: str, batch: RankBatch, algo: None, optim: OptimizerConfig, micro_batch_size: int,
                       max_tokens_per_microbatch: int | None = None, pack_sequences: bool = False,
                       share_prompt: bool = False) -> UpdateResult | None:
    """One optimizer step of the Bradley-Terry loss on the value head's score of each answer's
    last token (``seq_lens``); ``batch.margin`` [B] (the pair's, on both rows) is optional."""
    from megarl.models.forward import rows_output

    _check_pairs(key, batch, micro_batch_size, max_tokens_per_microbatch, pack_sequences)

    def loss_fn(output: torch.Tensor, mb: MicroBatch) -> LossOutput:
        _pair_rows(mb)
        values = positions(rows_output(output, mb.inputs), mb)
        scores = values[mb.seq_row, mb.seq_start + mb.seq_lens - 1, 0].float()
        margin = mb.margin[0::2] if mb.margin is not None else None
        return LossOutput(*bradley_terry_loss(scores[0::2], scores[1::2], mb.denom, margin))

    return run_update(key, batch, optim, micro_batch_size, 1, 1, loss_fn, None, False, metrics=RM_METRICS)


def train_dpo(key: str, batch: RankBatch, algo: DpoConfig, optim: OptimizerConfig, micro_batch_size: int,
              max_tokens_per_microbatch: int | None = None, pack_sequences: bool = False,
              share_prompt: bool = False) -> UpdateResult | None:
    """One optimizer step of ``algo``'s DPO loss; ``batch.ref_logprobs`` [B, L-1] are the
    reference model's per-token log-probs (``rl_fns.logprobs`` of the reference group, or
    precomputed once), summed here over each answer's ``mask``."""
    from megarl.models.forward import rows_output

    settings = algo
    _check_pairs(key, batch, micro_batch_size, max_tokens_per_microbatch, pack_sequences)
    vocab = held(key).spec.arch.vocab_size

    def loss_fn(output: torch.Tensor, mb: MicroBatch) -> LossOutput:
        _pair_rows(mb)
        lp = label_stats(rows_output(output, mb.inputs), mb, vocab)
        mask = mb.mask.to(lp.dtype)
        policy, ref, tokens = (lp * mask).sum(1), (mb.ref_logprobs * mask).sum(1), mask.sum(1)
        pairs = PairLogprobs(policy[0::2], policy[1::2], ref[0::2], ref[1::2], tokens[0::2], tokens[1::2])
        return LossOutput(*dpo_loss(pairs, settings, mb.denom))

    return run_update(key, batch, optim, micro_batch_size, 1, 1, loss_fn, None, False, select=True,
                      metrics=DPO_METRICS)


def train_kto(key: str, batch: RankBatch, algo: DpoConfig, optim: OptimizerConfig, micro_batch_size: int,
              max_tokens_per_microbatch: int | None = None, pack_sequences: bool = False,
              share_prompt: bool = False) -> UpdateResult | None:
    """One optimizer step of the KTO loss (``megarl.algorithms.kto``) on unpaired rows: each row's
    ``desirable`` flag [B], the reference's per-token log-probs ``ref_logprobs`` [B, L-1] (summed
    here over ``mask``) and the step's reference point ``kto_kl`` (a number: the caller computes
    it from the step's mismatched rows before the step, ``kl_reference_point``). Rows stand alone,
    so any micro-batching works."""
    from megarl.models.forward import rows_output

    settings = algo
    vocab = held(key).spec.arch.vocab_size
    # every rank holds the whole batch: the step's count of desirable rows, for the reward metrics
    desirable_count = float(batch.desirable.bool().sum())
    kl = float(batch.kto_kl)

    def loss_fn(output: torch.Tensor, mb: MicroBatch) -> LossOutput:
        lp = label_stats(rows_output(output, mb.inputs), mb, vocab)
        mask = mb.mask.to(lp.dtype)
        policy, ref = (lp * mask).sum(1), (mb.ref_logprobs * mask).sum(1)
        return LossOutput(*kto_loss(policy, ref, mb.desirable, kl, settings, mb.denom, desirable_count))

    return run_update(key, batch, optim, micro_batch_size, 1, 1, loss_fn, max_tokens_per_microbatch,
                      pack_sequences, select=True, metrics=KTO_METRICS)
