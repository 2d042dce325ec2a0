"""Rank functions of the RL roles: scoring and updates on a held Megatron model.

Every rank receives the whole batch (Ray ships it once) and works on its
data-parallel shard; results come back from the reporting rank of each shard
(last pipeline stage, tensor rank 0) tagged with the shard index, and the
driver puts them together (``gather_shards``). Batches are dicts of tensors:
``tokens`` [B, L] (prompt + response, right-padded), ``mask`` [B, L-1] over
label positions that are response tokens, plus per-algorithm fields.
"""

from __future__ import annotations

from typing import Any

import torch

from megarl.models.logprobs import token_entropy, token_logprobs
from megarl.workers.megatron_model import HeldModel, held


def _shard(model: HeldModel, batch: dict[str, Any]) -> dict[str, Any]:
    dp, rank = model.info.dp, model.info.dp_rank
    out = {}
    for key, value in batch.items():
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            if value.shape[0] % dp:
                raise ValueError(f"batch of {value.shape[0]} sequences does not split over {dp} data-parallel ranks")
            out[key] = value.chunk(dp)[rank]
        else:
            out[key] = value
    return out


def _microbatches(batch: dict[str, Any], size: int) -> list[dict[str, Any]]:
    n = batch["tokens"].shape[0]
    if n % size:
        raise ValueError(f"{n} sequences per data-parallel rank are not a multiple of micro_batch_size={size}")
    return [{k: (v[i:i + size] if isinstance(v, torch.Tensor) and v.dim() > 0 else v) for k, v in batch.items()}
            for i in range(0, n, size)]


def _reporting(model: HeldModel) -> bool:
    from megatron.core import parallel_state as ps

    return ps.is_pipeline_last_stage(ignore_virtual=True) and model.info.tp_rank == 0


def gather_shards(results: list) -> Any:
    """Rank results -> one value in data-parallel order (tensors concatenated on dim 0)."""
    shards = sorted((r for r in results if r is not None), key=lambda r: r[0])
    values = [v for _, v in shards]
    if isinstance(values[0], dict):
        return {k: torch.cat([v[k] for v in values]) for k in values[0]}
    return torch.cat(values)


def _positions(tokens: torch.Tensor) -> torch.Tensor:
    return torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0).expand_as(tokens)


def _forward(key: str, batch: dict[str, Any], micro_batch_size: int, head) -> tuple[int, Any] | None:
    """Runs ``head(outputs, microbatch)`` on every micro-batch of this rank's shard, no grad."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    model = held(key)
    shard = _shard(model, batch)
    mbs = _microbatches(shard, micro_batch_size)
    results = []

    def step(data_iterator, chunk):
        mb = next(data_iterator)
        out = chunk(mb["tokens"], _positions(mb["tokens"]), None)
        return out, lambda o: (o.new_zeros(()), {"result": head(o, mb)})

    for chunk in model.chunks:
        chunk.eval()
    with torch.no_grad():
        outputs = get_forward_backward_func()(
            forward_step_func=step,
            data_iterator=[iter(mbs) for _ in model.chunks] if len(model.chunks) > 1 else iter(mbs),
            model=model.chunks, num_microbatches=len(mbs), seq_length=shard["tokens"].shape[1],
            micro_batch_size=micro_batch_size, forward_only=True)
    if not _reporting(model):
        return None
    results = [o["result"] for o in outputs]
    if isinstance(results[0], dict):
        return model.info.dp_rank, {k: torch.cat([r[k] for r in results]).cpu() for k in results[0]}
    return model.info.dp_rank, torch.cat(results).cpu()


def logprobs(key: str, batch: dict[str, Any], micro_batch_size: int, entropy: bool = False):
    """log p(tokens[:, 1:]) [B, L-1] (and the entropy of each prediction) under the model."""
    vocab = held(key).spec.arch.vocab_size

    def head(logits, mb):
        labels = mb["tokens"][:, 1:]
        lp = token_logprobs(logits[:, :-1], labels, vocab).float()
        if not entropy:
            return lp
        return {"logprobs": lp, "entropy": token_entropy(logits[:, :-1], vocab).float()}

    return _forward(key, batch, micro_batch_size, head)


def values(key: str, batch: dict[str, Any], micro_batch_size: int):
    """Critic values of the state before each label position [B, L-1]."""
    return _forward(key, batch, micro_batch_size, lambda v, mb: v[:, :-1, 0].float())


def scores(key: str, batch: dict[str, Any], micro_batch_size: int):
    """Reward-model score of each sequence [B]: the value head at its last token."""
    def head(v, mb):
        last = mb["seq_lens"] - 1
        return v[torch.arange(v.shape[0]), last, 0].float()

    return _forward(key, batch, micro_batch_size, head)


# --- updates ------------------------------------------------------------------------------


def ensure_optimizer(model: HeldModel, optim: dict) -> None:
    from megarl.models.train import OptimConfig, build_optimizer, wrap_ddp

    if model.optimizer is None:
        model.chunks = wrap_ddp(model.chunks, optim["use_distributed_optimizer"])
        model.optimizer = build_optimizer(model.chunks, OptimConfig(
            lr=optim["lr"], weight_decay=optim["weight_decay"], adam_beta1=optim["adam_beta1"],
            adam_beta2=optim["adam_beta2"], adam_eps=optim["adam_eps"], clip_grad=optim["clip_grad"],
            use_distributed_optimizer=optim["use_distributed_optimizer"]))
        model.extra["optimizer_steps"] = 0


def _set_lr(model: HeldModel, optim: dict) -> float:
    steps = model.extra["optimizer_steps"]
    warmup = optim["warmup_steps"]
    lr = optim["lr"] * min(1.0, (steps + 1) / warmup) if warmup > 0 else optim["lr"]
    for group in model.optimizer.param_groups:
        group["lr"] = lr
    return lr


def _update(key: str, batch: dict[str, Any], optim: dict, micro_batch_size: int, minibatches: int, epochs: int,
            loss_fn, forward) -> list[dict[str, float]] | None:
    """``epochs`` passes over ``minibatches`` optimizer steps on this rank's shard."""
    from megatron.core import parallel_state as ps

    from megarl.models.train import train_step

    model = held(key)
    ensure_optimizer(model, optim)
    shard = _shard(model, batch)
    n = shard["tokens"].shape[0]
    if n % minibatches:
        raise ValueError(f"{n} sequences per data-parallel rank do not split into {minibatches} minibatches")
    size = n // minibatches
    per_step = []
    for _ in range(epochs):
        for m in range(minibatches):
            part = {k: (v[m * size:(m + 1) * size] if isinstance(v, torch.Tensor) and v.dim() > 0 else v)
                    for k, v in shard.items()}
            part["denom"] = shard["denoms"][m]
            mbs = _microbatches(part, micro_batch_size)
            for mb in mbs:
                # megatron divides by the number of micro-batches and DDP averages over
                # data-parallel ranks; the losses use a global denominator, so undo both.
                mb["scale"] = len(mbs) * model.info.dp
            lr = _set_lr(model, optim)
            result = train_step(model.chunks, model.optimizer, mbs, loss_fn, forward)
            model.extra["optimizer_steps"] += 1
            metrics = {"grad_norm": float(result["grad_norm"] or 0.0), "lr": lr,
                       "skipped": float(not result["updated"])}
            if result["metrics"]:
                for name in result["metrics"][0]:
                    metrics[name] = sum(float(r[name]) for r in result["metrics"])
            per_step.append(metrics)
    if not (ps.is_pipeline_last_stage(ignore_virtual=True) and model.info.tp_rank == 0):
        return None
    return per_step


def train_policy(key: str, batch: dict[str, Any], algo: dict, optim: dict, micro_batch_size: int):
    """Clipped policy-gradient updates (+ KL and entropy terms) on ``batch``; per-step metrics."""
    from megarl.algorithms import aggregate, kl_loss, policy_loss

    vocab = held(key).spec.arch.vocab_size

    def loss_fn(logits, mb):
        mask = mb["mask"]
        lp = token_logprobs(logits[:, :-1], mb["tokens"][:, 1:], vocab)
        common = {"aggregation": algo["aggregation"], "denom": mb["denom"]}
        loss, metrics = policy_loss(lp, mb["old_logprobs"], mb["advantages"], mask, clip_low=algo["clip_low"],
                                    clip_high=algo["clip_high"], dual_clip=algo["dual_clip"], **common)
        out = {"pg_loss": loss.detach()}
        if algo["kl_coef"] > 0 and not algo["kl_in_reward"]:
            kl = kl_loss(lp, mb["ref_logprobs"], mask, estimator=algo["kl_estimator"], **common)
            loss = loss + algo["kl_coef"] * kl
            out["kl_loss"] = kl.detach()
        if algo["entropy_coef"] > 0:
            ent = aggregate(token_entropy(logits[:, :-1], vocab), mask, **common)
            loss = loss - algo["entropy_coef"] * ent
            out["entropy"] = ent.detach()
        weight = _share(mb, algo["aggregation"])
        for name in ("clip_fraction", "approx_kl", "ratio_mean"):
            out[name] = metrics[name] * weight
        return loss * mb["scale"], out

    return _update(key, batch, optim, micro_batch_size, algo["minibatches"], algo["ppo_epochs"], loss_fn,
                   _logits_forward)


def train_value(key: str, batch: dict[str, Any], algo: dict, optim: dict, micro_batch_size: int):
    """Clipped value-loss updates of the critic towards ``batch["returns"]``."""
    from megarl.algorithms import value_loss

    def loss_fn(out, mb):
        loss, metrics = value_loss(out[:, :-1, 0].float(), mb["old_values"], mb["returns"], mb["mask"],
                                   clip=algo["value_clip"], aggregation=algo["aggregation"], denom=mb["denom"])
        weight = _share(mb, algo["aggregation"])
        return loss * mb["scale"], {"value_loss": loss.detach(),
                                    "value_clip_fraction": metrics["clip_fraction"] * weight}

    return _update(key, batch, optim, micro_batch_size, algo["minibatches"], algo["ppo_epochs"], loss_fn,
                   _logits_forward)


def _share(mb: dict[str, Any], aggregation: str) -> torch.Tensor | float:
    """This micro-batch's share of the global denominator: per-micro-batch metrics times their
    share, summed over micro-batches and data-parallel ranks, give the global mean."""
    if aggregation == "token-mean":
        return mb["mask"].float().sum() / mb["denom"]
    return mb["tokens"].shape[0] / mb["denom"]


def _logits_forward(chunk, mb):
    return chunk(mb["tokens"], _positions(mb["tokens"]), None)
