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

from megarl.models.logprobs import next_token_logprobs
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


def _lengths(shard: dict[str, Any], width: int) -> list[int]:
    """Tokens of each sequence that matter: ``seq_lens`` when the batch has it, else up to
    the last response token of ``mask`` (later tokens feed no loss term). At least 2 (one
    label position), at most the padded width."""
    if "seq_lens" in shard:
        lengths = shard["seq_lens"]
    else:
        positions = torch.arange(1, width, device=shard["mask"].device)
        lengths = ((shard["mask"] != 0) * positions).amax(dim=1) + 1
    return [int(n) for n in lengths.clamp(min=2, max=width)]


def _microbatches(model: HeldModel, shard: dict[str, Any], micro_batch_size: int,
                  max_tokens: int | None = None, pack: bool = False) -> list[dict[str, Any]]:
    """This shard's micro-batches: fixed ``micro_batch_size`` rows of the padded batch, or (token
    budget / packing) rows cut to their longest sequence or packed; see ``plan_microbatches``.

    Each holds the model's input (``tokens`` [rows, width], ``inputs``), where its sequences
    sit (``index`` into the shard, ``gather`` / ``valid`` [b, T] over label positions,
    ``seq_row`` / ``seq_start``), and every per-sequence field of the shard for its sequences,
    token-level ones ([n, L-1]) cut to the micro-batch's ``T`` label positions.
    """
    from megarl.data.batching import plan_microbatches
    from megarl.models.forward import rows_inputs

    tokens = shard["tokens"]
    n, width = tokens.shape
    trimmed = max_tokens is not None or pack
    lengths = _lengths(shard, width) if trimmed else [width] * n
    par = model.spec.parallel
    multiple = par.tp if par.sequence_parallel else 1
    device = next(model.chunks[0].parameters()).device
    out = []
    for plan in plan_microbatches(lengths, width, micro_batch_size, max_tokens, pack, multiple):
        index = torch.tensor(plan.index)
        rows = torch.zeros(plan.rows, plan.width, dtype=tokens.dtype)  # padding: any valid id
        for k, i in enumerate(plan.index):
            begin, length = plan.start[k], plan.length[k]
            rows[plan.row[k], begin:begin + length] = tokens[i, :length]
        gather, valid = plan.label_gather()
        labels = plan.label_width
        mb = {"plan": plan, "index": index, "tokens": rows, "gather": gather, "valid": valid,
              "seq_row": torch.tensor(plan.row), "seq_start": torch.tensor(plan.start)}
        for key, value in shard.items():
            if key == "tokens" or not isinstance(value, torch.Tensor) or value.dim() == 0 or value.shape[0] != n:
                mb.setdefault(key, value)
            elif value.dim() >= 2 and value.shape[1] == width - 1:
                mb[key] = value[index, :labels]
            else:
                mb[key] = value[index]
        mb = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in mb.items()}
        mb["inputs"] = rows_inputs(mb["tokens"], plan)
        out.append(mb)
    return out


def _per_label(x: torch.Tensor, mb: dict[str, Any]) -> torch.Tensor:
    """Per-position outputs of the rows, ``[rows, width-1, ...]`` -> each sequence's label
    positions ``[b, T, ...]`` (what the padded batch would have; 0 past a sequence's end)."""
    picked = x.reshape(-1, *x.shape[2:])[mb["gather"]]
    valid = mb["valid"].reshape(*mb["valid"].shape, *([1] * (picked.dim() - 2)))
    return torch.where(valid, picked, torch.zeros((), dtype=picked.dtype, device=picked.device))


def _label_stats(logits: torch.Tensor, mb: dict[str, Any], vocab: int, entropy: bool = False):
    """log p(next token) [b, T] of each sequence (and, with ``entropy``, each prediction's entropy),
    computed on the rows in one pass, where a packed sequence's last position predicts the next
    one's first token: never gathered. Passing the whole logits (not ``logits[:, :-1]``) spares
    autograd a logits-sized gradient for the slice."""
    if not entropy:
        return _per_label(next_token_logprobs(logits, mb["tokens"], vocab), mb)
    lp, ent = next_token_logprobs(logits, mb["tokens"], vocab, entropy=True)
    return _per_label(lp, mb), _per_label(ent, mb)


def _scatter(results: list, mbs: list[dict[str, Any]], n: int, width: int) -> Any:
    """Per-micro-batch results ([b, T] or [b]) back into the shard's order, [n, L-1] or [n]."""
    def place(parts: list[torch.Tensor]) -> torch.Tensor:
        first = parts[0]
        shape = (n, width - 1) if first.dim() == 2 else (n,)
        out = torch.zeros(shape, dtype=first.dtype)
        for part, mb in zip(parts, mbs, strict=True):
            index = mb["index"].cpu()
            if part.dim() == 2:
                out[index, :part.shape[1]] = part.cpu()
            else:
                out[index] = part.cpu()
        return out

    if isinstance(results[0], dict):
        return {k: place([r[k] for r in results]) for k in results[0]}
    return place(results)


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


def _forward(key: str, batch: dict[str, Any], micro_batch_size: int, head, max_tokens: int | None,
             pack: bool) -> tuple[int, Any] | None:
    """Runs ``head(outputs [rows, width, ...], microbatch)`` on every micro-batch of this rank's
    shard, no grad; the results come back in the shard's order."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megarl.models.forward import rows_forward, rows_output, schedule_shape

    model = held(key)
    shard = _shard(model, batch)
    mbs = _microbatches(model, shard, micro_batch_size, max_tokens, pack)

    def step(data_iterator, chunk):
        mb = next(data_iterator)
        out = rows_forward(chunk, mb["inputs"])
        return out, lambda o: (o.new_zeros(()), {"result": head(rows_output(o, mb["inputs"]), mb)})

    for chunk in model.chunks:
        chunk.eval()
    seq_length, rows = schedule_shape(model.chunks, [tuple(mb["inputs"]["input_ids"].shape) for mb in mbs])
    with torch.no_grad():
        outputs = get_forward_backward_func()(
            forward_step_func=step,
            data_iterator=[iter(mbs) for _ in model.chunks] if len(model.chunks) > 1 else iter(mbs),
            model=model.chunks, num_microbatches=len(mbs), seq_length=seq_length,
            micro_batch_size=rows, forward_only=True)
    if not _reporting(model):
        return None
    n, width = shard["tokens"].shape
    return model.info.dp_rank, _scatter([o["result"] for o in outputs], mbs, n, width)


def logprobs(key: str, batch: dict[str, Any], micro_batch_size: int, entropy: bool = False,
             max_tokens_per_microbatch: int | None = None, pack_sequences: bool = False):
    """log p(tokens[:, 1:]) [B, L-1] (and the entropy of each prediction) under the model; 0 past
    each sequence's end when micro-batches are cut or packed (``seq_lens``)."""
    vocab = held(key).spec.arch.vocab_size

    def head(logits, mb):
        if not entropy:
            return _label_stats(logits, mb, vocab).float()
        lp, ent = _label_stats(logits, mb, vocab, entropy=True)
        return {"logprobs": lp.float(), "entropy": ent.float()}

    return _forward(key, batch, micro_batch_size, head, max_tokens_per_microbatch, pack_sequences)


def values(key: str, batch: dict[str, Any], micro_batch_size: int, max_tokens_per_microbatch: int | None = None,
           pack_sequences: bool = False):
    """Critic values of the state before each label position [B, L-1]."""
    return _forward(key, batch, micro_batch_size, lambda v, mb: _per_label(v[:, :-1, 0], mb).float(),
                    max_tokens_per_microbatch, pack_sequences)


def scores(key: str, batch: dict[str, Any], micro_batch_size: int, max_tokens_per_microbatch: int | None = None,
           pack_sequences: bool = False):
    """Reward-model score of each sequence [B]: the value head at its last token."""
    def head(v, mb):
        return v[mb["seq_row"], mb["seq_start"] + mb["seq_lens"] - 1, 0].float()

    return _forward(key, batch, micro_batch_size, head, max_tokens_per_microbatch, pack_sequences)


# --- updates ------------------------------------------------------------------------------


def ensure_optimizer(model: HeldModel, optim: dict) -> None:
    from megarl.models.train import build_optimizer, wrap_ddp

    if model.optimizer is None:
        model.chunks = wrap_ddp(model.chunks, optim["use_distributed_optimizer"])
        model.optimizer = build_optimizer(model.chunks, optim)
        model.extra["optimizer_steps"] = 0


def _set_lr(model: HeldModel, optim: dict) -> float:
    steps = model.extra["optimizer_steps"]
    warmup = optim["warmup_steps"]
    lr = optim["lr"] * min(1.0, (steps + 1) / warmup) if warmup > 0 else optim["lr"]
    for group in model.optimizer.param_groups:
        group["lr"] = lr
    return lr


def _update(key: str, batch: dict[str, Any], optim: dict, micro_batch_size: int, minibatches: int, epochs: int,
            loss_fn, max_tokens: int | None, pack: bool) -> list[dict[str, float]] | None:
    """``epochs`` passes over ``minibatches`` optimizer steps on this rank's shard."""
    from megarl.models.forward import rows_forward
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
            mbs = _microbatches(model, part, micro_batch_size, max_tokens, pack)
            for mb in mbs:
                # megatron divides each micro-batch's loss by this rank's number of micro-batches
                # (which may differ between ranks under a token budget) and DDP averages over
                # data-parallel ranks; the losses use a global denominator, so undo both.
                mb["scale"] = len(mbs) * model.info.dp
            lr = _set_lr(model, optim)
            result = train_step(model.chunks, model.optimizer, mbs, loss_fn,
                                lambda chunk, mb: rows_forward(chunk, mb["inputs"]))
            model.extra["optimizer_steps"] += 1
            metrics = {"grad_norm": float(result["grad_norm"] or 0.0), "lr": lr,
                       "skipped": float(not result["updated"])}
            if result["metrics"]:
                for name in result["metrics"][0]:
                    metrics[name] = sum(float(r[name]) for r in result["metrics"])
            per_step.append(metrics)
    if not _reporting(model):
        return None
    return per_step


def train_policy(key: str, batch: dict[str, Any], algo: dict, optim: dict, micro_batch_size: int,
                 max_tokens_per_microbatch: int | None = None, pack_sequences: bool = False):
    """Clipped policy-gradient updates (+ KL and entropy terms) on ``batch``; per-step metrics."""
    from megarl.algorithms import aggregate, kl_loss, policy_loss
    from megarl.models.forward import rows_output

    vocab = held(key).spec.arch.vocab_size

    def loss_fn(output, mb):
        logits = rows_output(output, mb["inputs"])
        mask = mb["mask"]
        with_entropy = algo["entropy_coef"] > 0
        if with_entropy:
            lp, ent = _label_stats(logits, mb, vocab, entropy=True)
        else:
            lp = _label_stats(logits, mb, vocab)
        common = {"aggregation": algo["aggregation"], "denom": mb["denom"]}
        loss, metrics = policy_loss(lp, mb["old_logprobs"], mb["advantages"], mask, clip_low=algo["clip_low"],
                                    clip_high=algo["clip_high"], dual_clip=algo["dual_clip"], **common)
        out = {"pg_loss": loss.detach()}
        if algo["kl_coef"] > 0 and not algo["kl_in_reward"]:
            kl = kl_loss(lp, mb["ref_logprobs"], mask, estimator=algo["kl_estimator"], **common)
            loss = loss + algo["kl_coef"] * kl
            out["kl_loss"] = kl.detach()
        if with_entropy:
            ent = aggregate(ent, mask, mode=algo["aggregation"], denom=mb["denom"])
            loss = loss - algo["entropy_coef"] * ent
            out["entropy"] = ent.detach()
        weight = _share(mb, algo["aggregation"])
        for name in ("clip_fraction", "approx_kl", "ratio_mean"):
            out[name] = metrics[name] * weight
        return loss * mb["scale"], out

    return _update(key, batch, optim, micro_batch_size, algo["minibatches"], algo["ppo_epochs"], loss_fn,
                   max_tokens_per_microbatch, pack_sequences)


def train_value(key: str, batch: dict[str, Any], algo: dict, optim: dict, micro_batch_size: int,
                max_tokens_per_microbatch: int | None = None, pack_sequences: bool = False):
    """Clipped value-loss updates of the critic towards ``batch["returns"]``."""
    from megarl.algorithms import value_loss
    from megarl.models.forward import rows_output

    def loss_fn(output, mb):
        values = _per_label(rows_output(output, mb["inputs"])[:, :-1, 0], mb).float()
        loss, metrics = value_loss(values, mb["old_values"], mb["returns"], mb["mask"],
                                   clip=algo["value_clip"], aggregation=algo["aggregation"], denom=mb["denom"])
        weight = _share(mb, algo["aggregation"])
        return loss * mb["scale"], {"value_loss": loss.detach(),
                                    "value_clip_fraction": metrics["clip_fraction"] * weight}

    return _update(key, batch, optim, micro_batch_size, algo["minibatches"], algo["ppo_epochs"], loss_fn,
                   max_tokens_per_microbatch, pack_sequences)


def _share(mb: dict[str, Any], aggregation: str) -> torch.Tensor | float:
    """This micro-batch's share of the global denominator: per-micro-batch metrics times their
    share, summed over micro-batches and data-parallel ranks, give the global mean."""
    if aggregation == "token-mean":
        return mb["mask"].float().sum() / mb["denom"]
    # the seq modes' denominator counts the sequences with response tokens (see denominators())
    return (mb["mask"].sum(dim=1) > 0).float().sum() / mb["denom"]
