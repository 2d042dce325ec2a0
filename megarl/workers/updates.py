"""The optimizer steps every training rank function shares: the RL roles' policy and value updates
(``megarl.workers.rl_fns``) and the supervised stages' (``megarl.workers.preference_fns``) differ in
their loss only.

An update is ``epochs`` passes over ``minibatches`` optimizer steps on the rank's data-parallel
shard, each step over the minibatch's micro-batches (``megarl.workers.microbatches``). The loss of a
micro-batch (a ``RankLoss``) is its share of the step's loss under a global normaliser (``denom``),
with its metrics, each declared with the way shards combine it (``megarl.algorithms.base.Metric``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from megarl.algorithms.base import Metric, combine
from megarl.config.schema import OptimizerConfig
from megarl.workers.megatron_model import HeldModel, held
from megarl.workers.microbatches import MicroBatch, microbatches, scatter_stats
from megarl.workers.rank_batch import RankBatch
from megarl.workers.rank_results import ShardResult, TokenStats, UpdateResult, reporting

# what every optimizer step reports besides its loss's metrics
STEP_METRICS = (Metric("grad_norm", "same"), Metric("lr", "same"), Metric("skipped", "same"))


@dataclass
class LossOutput:
    """What a rank's loss gives for one micro-batch."""

    loss: torch.Tensor  # its share of the step's loss
    metrics: dict[str, torch.Tensor]  # its share of each metric the loss declares
    per_token: TokenStats | None = None  # per-token outputs [b, T], sent back in the shard's order


# (the model's output on the micro-batch's rows, the micro-batch) -> its loss
RankLoss = Callable[[torch.Tensor, MicroBatch], LossOutput]


def ensure_optimizer(model: HeldModel, optim: OptimizerConfig) -> None:
    from megarl.models.train import build_optimizer, wrap_ddp

    if model.optimizer is None:
        model.chunks = wrap_ddp(model.chunks, optim.use_distributed_optimizer)
        model.optimizer = build_optimizer(model.chunks, optim)
        model.extra["optimizer_steps"] = 0


def _set_lr(model: HeldModel, optim: OptimizerConfig) -> float:
    steps = model.extra["optimizer_steps"]
    warmup = optim.warmup_steps
    lr = optim.lr * min(1.0, (steps + 1) / warmup) if warmup > 0 else optim.lr
    for group in model.optimizer.param_groups:
        group["lr"] = lr
    return lr


def run_update(key: str, batch: RankBatch, optim: OptimizerConfig, micro_batch_size: int, minibatches: int,
               epochs: int, loss_fn: RankLoss, max_tokens: int | None, pack: bool, select: bool = False,
               share: bool = False, metrics: tuple[Metric, ...] = ()) -> UpdateResult | None:
    """``epochs`` passes over ``minibatches`` optimizer steps on this rank's shard of ``batch``.

    The reporting rank of each shard returns the metrics of every step; the loss's per-token
    outputs come back, in the shard's order, when one step covers the whole shard once (then they
    are the pre-update model's). Every metric the loss emits must be in ``metrics``.
    """
    from megarl.models.forward import rows_forward
    from megarl.models.train import train_step

    model = held(key)
    ensure_optimizer(model, optim)
    shard = batch.shard(model.info.dp, model.info.dp_rank)
    n = shard.size
    if n % minibatches:
        raise ValueError(f"{n} sequences per data-parallel rank do not split into {minibatches} minibatches")
    size = n // minibatches
    reduce = {m.name: m.reduce for m in STEP_METRICS + metrics}
    per_step, per_token = [], None
    for _ in range(epochs):
        for m in range(minibatches):
            mbs = microbatches(model, shard.rows(m * size, (m + 1) * size), micro_batch_size, max_tokens, pack,
                               select, share, denom=shard.denoms[m])
            # megatron divides each micro-batch's loss by this rank's number of micro-batches
            # (which may differ between ranks under a token budget) and DDP averages over
            # data-parallel ranks; the losses use a global denominator, so undo both.
            scale = len(mbs) * model.info.dp

            def step_loss(output: torch.Tensor, mb: MicroBatch, scale: int = scale) -> tuple[torch.Tensor, LossOutput]:
                out = loss_fn(output, mb)
                return out.loss * scale, out

            lr = _set_lr(model, optim)
            result = train_step(model.chunks, model.optimizer, mbs, step_loss,
                                lambda chunk, mb: rows_forward(chunk, mb.inputs),
                                shapes=[tuple(mb.inputs.input_ids.shape) for mb in mbs])
            model.extra["optimizer_steps"] += 1
            step = {"grad_norm": float(result.grad_norm or 0.0), "lr": lr, "skipped": float(not result.updated)}
            for name, value in result.moe.items():  # equal on every rank after the tracker's reduction
                step[f"moe/{name}"] = value
                reduce[f"moe/{name}"] = "same"
            outputs: list[LossOutput] = result.outputs  # the last pipeline stage's, one per micro-batch
            if outputs:
                if outputs[0].per_token is not None and epochs == minibatches == 1:
                    stats = scatter_stats([o.per_token for o in outputs], mbs, n, shard.tokens.shape[1])
                    per_token = ShardResult(model.info.dp_rank, stats)
                for name in outputs[0].metrics:
                    if name not in reduce:
                        raise ValueError(f"the loss emits the metric {name!r} but does not declare it "
                                         "(megarl.algorithms.base.Metric), so the driver cannot combine it")
                    step[name] = combine([float(o.metrics[name]) for o in outputs], reduce[name])
            per_step.append(step)
    if not reporting(model):
        return None
    return UpdateResult(per_step, {name: reduce[name] for name in per_step[0]}, per_token)
