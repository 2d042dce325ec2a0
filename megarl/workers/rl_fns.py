"""Rank functions of the RL roles: scoring and updates on a held Megatron model.

Every rank receives the whole batch (a ``RankBatch``; Ray ships it once) and works on its
data-parallel shard, cut into micro-batches (``megarl.workers.microbatches``); results come back
from the reporting rank of each shard (last pipeline stage, tensor rank 0) as a ``ShardResult``
or an ``UpdateResult``, and the driver puts them together (``megarl.workers.rank_results``). The
updates hand each micro-batch to the algorithm (``megarl.algorithms``) as a typed micro-batch.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from megarl.algorithms.base import VALUE_METRICS, PolicyMicroBatch, ValueMicroBatch
from megarl.algorithms.registry import get_algorithm
from megarl.config.schema import AlgorithmConfig, OptimizerConfig
from megarl.workers.label_stats import label_stats, per_label, positions
from megarl.workers.megatron_model import held
from megarl.workers.microbatches import MicroBatch, microbatches, scatter, scatter_stats
from megarl.workers.rank_batch import RankBatch
from megarl.workers.rank_results import ShardResult, TokenStats, UpdateResult, reporting
from megarl.workers.updates import LossOutput, run_update


def _forward(key: str, batch: RankBatch, micro_batch_size: int,
             head: Callable[[torch.Tensor, MicroBatch], torch.Tensor | TokenStats], max_tokens: int | None,
             pack: bool, select: bool = False, share: bool = False) -> ShardResult | None:
    """Runs ``head(outputs [rows, width, ...], microbatch)`` on every micro-batch of this rank's
    shard, no grad; the results come back in the shard's order."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megarl.models.forward import rows_forward, rows_output, schedule_shape

    model = held(key)
    shard = batch.shard(model.info.dp, model.info.dp_rank)
    mbs = microbatches(model, shard, micro_batch_size, max_tokens, pack, select, share)

    def step(data_iterator, chunk):
        mb = next(data_iterator)
        out = rows_forward(chunk, mb.inputs)
        return out, lambda o: (o.new_zeros(()), head(rows_output(o, mb.inputs), mb))

    for chunk in model.chunks:
        chunk.eval()
    seq_length, rows = schedule_shape(model.chunks, [tuple(mb.inputs.input_ids.shape) for mb in mbs])
    with torch.no_grad():
        outputs = get_forward_backward_func()(
            forward_step_func=step,
            data_iterator=[iter(mbs) for _ in model.chunks] if len(model.chunks) > 1 else iter(mbs),
            model=model.chunks, num_microbatches=len(mbs), seq_length=seq_length,
            micro_batch_size=rows, forward_only=True)
    if not reporting(model):
        return None
    n, width = shard.tokens.shape
    gathered = scatter_stats(outputs, mbs, n, width) if isinstance(outputs[0], TokenStats) \
        else scatter(outputs, mbs, n, width)
    return ShardResult(model.info.dp_rank, gathered)


def logprobs(key: str, batch: RankBatch, micro_batch_size: int, entropy: bool = False,
             max_tokens_per_microbatch: int | None = None, pack_sequences: bool = False,
             share_prompt: bool = False, response_only: bool = True, base_only: bool = False) -> ShardResult | None:
    """log p(tokens[:, 1:]) [B, L-1] (with ``entropy``: ``TokenStats`` with each prediction's
    entropy) under the model; 0 past each sequence's end when micro-batches are cut or packed
    (``seq_lens``). With ``response_only`` (the RL roles' case) only the label positions in
    ``batch.mask`` are computed, and the others are 0; ``share_prompt`` then computes each prompt
    once for its consecutive samples. ``base_only``: a LoRA model's base, its adapters off (the
    reference policy of a LoRA actor, from the actor's own weights)."""
    import contextlib

    from megarl.models.lora import adapters_disabled

    vocab = held(key).spec.arch.vocab_size

    def head(logits, mb):
        if not entropy:
            return label_stats(logits, mb, vocab).float()
        lp, ent = label_stats(logits, mb, vocab, entropy=True)
        return TokenStats(lp.float(), ent.float())

    with adapters_disabled(held(key).chunks) if base_only else contextlib.nullcontext():
        return _forward(key, batch, micro_batch_size, head, max_tokens_per_microbatch, pack_sequences,
                        select=response_only, share=share_prompt)


def values(key: str, batch: RankBatch, micro_batch_size: int, max_tokens_per_microbatch: int | None = None,
           pack_sequences: bool = False, share_prompt: bool = False) -> ShardResult | None:
    """Critic values of the state before each label position [B, L-1]. (Value heads read every
    position, so ``share_prompt``, a policy-side saving, does not apply.)"""
    return _forward(key, batch, micro_batch_size, lambda v, mb: per_label(positions(v, mb)[:, :-1, 0], mb).float(),
                    max_tokens_per_microbatch, pack_sequences)


def scores(key: str, batch: RankBatch, micro_batch_size: int, max_tokens_per_microbatch: int | None = None,
           pack_sequences: bool = False, share_prompt: bool = False) -> ShardResult | None:
    """Reward-model score of each sequence [B]: the value head at its last token."""
    def head(v, mb):
        return positions(v, mb)[mb.seq_row, mb.seq_start + mb.seq_lens - 1, 0].float()

    return _forward(key, batch, micro_batch_size, head, max_tokens_per_microbatch, pack_sequences)


def routing_replay_counts(key: str) -> tuple[int, int]:
    """(token-layer routings this rank replayed and compared, of them differing from the
    model's own top-k) since the last call (``megarl.models.routing_replay``)."""
    from megarl.models.routing_replay import take_counts

    return take_counts(held(key).chunks)


# --- updates ------------------------------------------------------------------------------


def train_policy(key: str, batch: RankBatch, algo: AlgorithmConfig, optim: OptimizerConfig, micro_batch_size: int,
                 max_tokens_per_microbatch: int | None = None, pack_sequences: bool = False,
                 share_prompt: bool = False) -> UpdateResult | None:
    """The policy updates of ``algo``'s algorithm (its ``loss`` on each micro-batch) on ``batch``;
    see ``run_update``.

    Without ``batch.old_logprobs`` the update is on-policy (one epoch, one minibatch): the
    behaviour policy is the model as it is, so the ratio is ``exp(lp - lp.detach())`` (1, with
    the policy gradient) and no separate scoring pass is needed. The log-probs and entropy of
    that forward come back per token instead, at the positions of ``select_mask``, for the
    step's metrics."""
    from megarl.models.forward import rows_output

    algorithm = get_algorithm(algo.name)
    vocab = held(key).spec.arch.vocab_size
    on_policy = batch.old_logprobs is None
    if on_policy and (algo.ppo_epochs != 1 or algo.minibatches != 1):
        raise ValueError(f"no old_logprobs: an update of {algo.ppo_epochs} epoch(s) x {algo.minibatches} "
                         "minibatch(es) is off-policy after its first step and needs them")

    def loss_fn(output: torch.Tensor, mb: MicroBatch) -> LossOutput:
        logits = rows_output(output, mb.inputs)
        ent = None
        if algo.entropy_coef > 0 or on_policy:
            lp, ent = label_stats(logits, mb, vocab, entropy=True)
        else:
            lp = label_stats(logits, mb, vocab)
        # norm_len: "seq-mean-token-sum"'s constant divisor (Dr.GRPO), from the driver's denominators()
        step = PolicyMicroBatch(logprobs=lp, old_logprobs=lp.detach() if on_policy else mb.old_logprobs,
                                advantages=mb.advantages, mask=mb.mask, denom=mb.denom, norm_len=mb.norm_len,
                                ref_logprobs=mb.ref_logprobs, entropy=ent, rollout_logprobs=mb.rollout_logprobs)
        loss, out = algorithm.loss(algo, step)
        per_token = TokenStats(lp.detach().float(), ent.detach().float()) if on_policy else None
        return LossOutput(loss, out, per_token)

    return run_update(key, batch, optim, micro_batch_size, algo.minibatches, algo.ppo_epochs, loss_fn,
                      max_tokens_per_microbatch, pack_sequences, select=True, share=share_prompt,
                      metrics=algorithm.loss_metrics())


def train_value(key: str, batch: RankBatch, algo: AlgorithmConfig, optim: OptimizerConfig, micro_batch_size: int,
                max_tokens_per_microbatch: int | None = None, pack_sequences: bool = False,
                share_prompt: bool = False) -> UpdateResult | None:
    """The critic's clipped value-loss updates towards ``batch.returns`` (``Algorithm.value_loss``)."""
    from megarl.models.forward import rows_output

    algorithm = get_algorithm(algo.name)

    def loss_fn(output: torch.Tensor, mb: MicroBatch) -> LossOutput:
        values = per_label(positions(rows_output(output, mb.inputs), mb)[:, :-1, 0], mb).float()
        step = ValueMicroBatch(values=values, old_values=mb.old_values, returns=mb.returns, mask=mb.mask,
                               denom=mb.denom, norm_len=mb.norm_len)
        return LossOutput(*algorithm.value_loss(algo, step))

    return run_update(key, batch, optim, micro_batch_size, algo.minibatches, algo.ppo_epochs, loss_fn,
                      max_tokens_per_microbatch, pack_sequences, metrics=VALUE_METRICS)
