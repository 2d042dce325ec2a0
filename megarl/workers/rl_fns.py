"""Rank functions of the RL roles: scoring and updates on a held Megatron model.

Every rank receives the whole batch (Ray ships it once) and works on its
data-parallel shard; results come back from the reporting rank of each shard
(last pipeline stage, tensor rank 0) tagged with the shard index, and the
driver puts them together (``gather_shards``). Batches are dicts of tensors:
``tokens`` [B, L] (prompt + response, right-padded), ``mask`` [B, L-1] over
label positions that are response tokens, plus per-algorithm fields. The updates hand each
micro-batch to the algorithm (``megarl.algorithms``) as a typed micro-batch.
"""

from __future__ import annotations

from typing import Any

import torch

from megarl.algorithms.base import VALUE_METRICS, Metric, PolicyMicroBatch, ValueMicroBatch, combine
from megarl.algorithms.registry import get_algorithm
from megarl.config.schema import AlgorithmConfig, OptimizerConfig
from megarl.models.context_parallel import CpSplit, sequence_multiple
from megarl.models.logprobs import next_token_logprobs
from megarl.models.vocab_parallel import vocab_parallel_stats
from megarl.workers.megatron_model import HeldModel, held
from megarl.workers.rank_batch import RankBatch, placeholder_routes


def _plain(batch: RankBatch | dict[str, Any]) -> dict[str, Any]:
    """The batch's set fields by name (tests and tools may pass such a dict directly)."""
    return batch.present() if isinstance(batch, RankBatch) else batch


def _shard(model: HeldModel, batch: RankBatch | dict[str, Any]) -> dict[str, Any]:
    dp, rank = model.info.dp, model.info.dp_rank
    out = {}
    for key, value in _plain(batch).items():
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
                  max_tokens: int | None = None, pack: bool = False, select: bool = False,
                  share: bool = False) -> list[dict[str, Any]]:
    """This shard's micro-batches: fixed ``micro_batch_size`` rows of the padded batch, or (token
    budget / packing) rows cut to their longest sequence or packed; see ``plan_microbatches``.
    With ``select``, the model projects onto the vocabulary only at the response label
    positions (``_select_labels``); with ``select`` and ``share`` as well, consecutive samples of
    one prompt share a single copy of it (``plan_shared_prompts``).

    Each holds the model's input (``tokens`` [rows, width], ``inputs``), where its sequences
    sit (``index`` into the shard, ``gather`` / ``valid`` [b, T] over label positions,
    ``seq_row`` / ``seq_start``), and every per-sequence field of the shard for its sequences,
    token-level ones ([n, L-1]) cut to the micro-batch's ``T`` label positions.
    """
    from megarl.data.batching import plan_microbatches, plan_shared_prompts
    from megarl.models.forward import rows_inputs
    from megarl.platform import current_platform

    tokens = shard["tokens"]
    n, width = tokens.shape
    par = model.spec.parallel
    # shared prompts need an explicit attention mask (the local spec) and whole sequences per rank
    share = share and select and par.cp == 1 and current_platform().layer_spec_kind != "te"
    trimmed = max_tokens is not None or pack or share
    lengths = _lengths(shard, width) if trimmed else [width] * n
    multiple = sequence_multiple(par.tp, par.sequence_parallel, par.cp)
    device = next(model.chunks[0].parameters()).device
    if share:
        prompts = _prompt_lens(shard, lengths)
        same = [i > 0 and prompts[i] == prompts[i - 1]
                and torch.equal(tokens[i, :prompts[i]], tokens[i - 1, :prompts[i]]) for i in range(n)]
        plans = plan_shared_prompts(lengths, prompts, same, micro_batch_size, max_tokens, multiple)
    else:
        plans = plan_microbatches(lengths, width, micro_batch_size, max_tokens, pack, multiple)
    out = []
    for plan in plans:
        index = torch.tensor(plan.index)
        rows = torch.zeros(plan.rows, plan.width, dtype=tokens.dtype)  # padding: any valid id
        for k, i in enumerate(plan.index):
            rows[plan.row[k], plan.columns(k)] = tokens[i, :plan.length[k]]
        gather, valid = plan.label_gather()
        labels = plan.label_width
        mb = {"plan": plan, "index": index, "tokens": rows, "gather": gather, "valid": valid,
              "seq_row": torch.tensor(plan.row), "seq_start": torch.tensor(plan.start)}
        if "routes" in shard:  # rollout routing replay: each token's experts, laid out as its token
            mb["routes"], mb["route_valid"] = _rows_routes(shard["routes"], plan, _lengths(shard, width))
        for key, value in shard.items():
            if key == "routes":
                continue
            if key == "tokens" or not isinstance(value, torch.Tensor) or value.dim() == 0 or value.shape[0] != n:
                mb.setdefault(key, value)
            elif value.dim() >= 2 and value.shape[1] == width - 1:
                mb[key] = value[index, :labels]
            else:
                mb[key] = value[index]
        mb = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in mb.items()}
        mb["inputs"] = rows_inputs(mb["tokens"], plan)
        if "routes" in mb:
            mb["inputs"] |= {"routes": mb.pop("routes"), "route_valid": mb.pop("route_valid")}
        if par.cp > 1:  # every position stays: each rank computes its share of them
            mb["inputs"] = CpSplit(par.cp, model.info.cp_rank, plan.width).inputs(mb["inputs"])
            if select:  # the results outside the selection are 0, as when selected
                mb["cp_keep"] = mb["valid"] & _responses(mb)
        elif select:
            _select_labels(mb, plan, tokens[index, 1:labels + 1].to(device))
        out.append(mb)
    return out


def _rows_routes(routes: torch.Tensor, plan, lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``routes`` [n, L, layers, k] placed as ``plan`` places the tokens: ``[rows, width, layers, k]``,
    and ``[rows, width]`` True where a real routing sits: the first ``lengths[i] - 1`` tokens of
    sequence i (not padding, nor its last token, whose routes are a placeholder). Padding routes
    to experts 0..k-1, a valid placeholder."""
    out = placeholder_routes(plan.rows, plan.width, routes)
    valid = torch.zeros(plan.rows, plan.width, dtype=torch.bool)
    for j, i in enumerate(plan.index):
        columns = plan.columns(j)
        out[plan.row[j], columns] = routes[i, :plan.length[j]]
        valid[plan.row[j], columns[:min(plan.length[j], lengths[i]) - 1]] = True
    return out, valid


def routing_replay_counts(key: str) -> tuple[int, int]:
    """(token-layer routings this rank replayed and compared, of them differing from the
    model's own top-k) since the last call (``megarl.models.routing_replay``)."""
    from megarl.models.routing_replay import take_counts

    return take_counts(held(key).chunks)


def _responses(batch: dict[str, Any]) -> torch.Tensor:
    """[n, T] bool: the label positions of response tokens whose log-probs the step needs
    (``select_mask`` when the batch has one: every response, for the metrics; else ``mask``)."""
    return batch.get("select_mask", batch["mask"]) != 0


def _prompt_lens(shard: dict[str, Any], lengths: list[int]) -> list[int]:
    """Each sequence's prompt length: up to its first response label position (``_responses``);
    a sequence without one counts as all prompt but its last token, so it shares only with an
    identical sequence."""
    mask = _responses(shard)
    first = mask.float().argmax(dim=1)
    return [int(f) + 1 if m else n - 1 for f, m, n in zip(first, mask.any(dim=1), lengths, strict=True)]


def _select_labels(mb: dict[str, Any], plan, labels: torch.Tensor) -> None:
    """Marks the label positions whose log-probs the step needs (``_responses``). The model then
    computes logits there only; the results come back at the same [b, T] places, 0 elsewhere
    (see ``_label_stats``). ``labels`` [b, T] are each sequence's next tokens (a shared prompt's
    last column has several)."""
    keep = mb["valid"] & _responses(mb)
    if not keep.any():  # nothing needed: compute one position (shared rows have no other path) and zero it
        keep = torch.zeros_like(keep)
        keep[0, 0] = True
        mb["selected_zero"] = True
    flat = mb["gather"][keep]  # into rows x (width - 1) label positions
    positions = flat // (plan.width - 1) * plan.width + flat % (plan.width - 1)  # into rows x width
    mb["inputs"]["select"] = positions
    mb["selected_labels"] = labels[keep]
    mb["selected_at"] = keep.reshape(-1).nonzero().squeeze(1)  # where each result goes in [b * T]


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
    autograd a logits-sized gradient for the slice. Logits of selected positions only
    (``[1, n, vocab/tp]``) give results there and 0 at the other label positions.

    ``mb["temperature"]`` (the rollout's): the distribution the tokens were sampled from is
    softmax(logits / T), and so is the one scored and trained here."""
    temperature = mb.get("temperature", 1.0)
    if temperature != 1.0:  # skipped at 1: the division would copy the logits for nothing
        logits = logits / temperature
    if (split := _cp_split(mb)) is not None:  # this rank's positions: gather the numbers
        lp, ent = vocab_parallel_stats(logits, split.next_tokens(mb["tokens"]), vocab, entropy=entropy)
        keep = mb.get("cp_keep", mb["valid"])

        def place(gathered):
            x = _per_label(gathered[:, :-1], mb)
            return torch.where(keep, x, torch.zeros((), dtype=x.dtype, device=x.device))

        if not entropy:
            return place(split.gather(lp))
        both = split.gather(torch.stack((lp, ent), dim=-1))  # one all-gather for the two
        return place(both[..., 0]), place(both[..., 1])
    if "selected_at" in mb:
        lp, ent = vocab_parallel_stats(logits[0], mb["selected_labels"], vocab, entropy=entropy)
        b, t = mb["valid"].shape

        def place(x):
            out = x.new_zeros(b * t).index_copy(0, mb["selected_at"], x).view(b, t)
            return out * 0 if mb.get("selected_zero") else out

        return (place(lp), place(ent)) if entropy else place(lp)
    if not entropy:
        return _per_label(next_token_logprobs(logits, mb["tokens"], vocab), mb)
    lp, ent = next_token_logprobs(logits, mb["tokens"], vocab, entropy=True)
    return _per_label(lp, mb), _per_label(ent, mb)


def _cp_split(mb: dict[str, Any]) -> CpSplit | None:
    """The micro-batch's context-parallel split (None: each rank has whole rows)."""
    return (mb.get("inputs") or {}).get("cp")


def _positions(output: torch.Tensor, mb: dict[str, Any]) -> torch.Tensor:
    """A per-position output ``[rows, width, ...]`` (a value head's): under context parallelism the
    model gives each rank its share, gathered here (logits never are: ``_label_stats``)."""
    split = _cp_split(mb)
    return output if split is None else split.gather(output)


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

    return ps.is_pipeline_last_stage(ignore_virtual=True) and model.info.tp_rank == model.info.cp_rank == 0


def gather_shards(results: list) -> Any:
    """Rank results -> one value in data-parallel order (tensors concatenated on dim 0)."""
    shards = sorted((r for r in results if r is not None), key=lambda r: r[0])
    values = [v for _, v in shards]
    if isinstance(values[0], dict):
        return {k: torch.cat([v[k] for v in values]) for k in values[0]}
    return torch.cat(values)


def _forward(key: str, batch: RankBatch | dict[str, Any], micro_batch_size: int, head, max_tokens: int | None,
             pack: bool, select: bool = False, share: bool = False) -> tuple[int, Any] | None:
    """Runs ``head(outputs [rows, width, ...], microbatch)`` on every micro-batch of this rank's
    shard, no grad; the results come back in the shard's order."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megarl.models.forward import rows_forward, rows_output, schedule_shape

    model = held(key)
    shard = _shard(model, batch)
    mbs = _microbatches(model, shard, micro_batch_size, max_tokens, pack, select, share)

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


def logprobs(key: str, batch: RankBatch | dict[str, Any], micro_batch_size: int, entropy: bool = False,
             max_tokens_per_microbatch: int | None = None, pack_sequences: bool = False,
             share_prompt: bool = False, response_only: bool = True):
    """log p(tokens[:, 1:]) [B, L-1] (and the entropy of each prediction) under the model; 0 past
    each sequence's end when micro-batches are cut or packed (``seq_lens``). With
    ``response_only`` (the RL roles' case) only the label positions in ``batch["mask"]`` are
    computed, and the others are 0; ``share_prompt`` then computes each prompt once for its
    consecutive samples."""
    vocab = held(key).spec.arch.vocab_size

    def head(logits, mb):
        if not entropy:
            return _label_stats(logits, mb, vocab).float()
        lp, ent = _label_stats(logits, mb, vocab, entropy=True)
        return {"logprobs": lp.float(), "entropy": ent.float()}

    return _forward(key, batch, micro_batch_size, head, max_tokens_per_microbatch, pack_sequences,
                    select=response_only, share=share_prompt)


def values(key: str, batch: RankBatch | dict[str, Any], micro_batch_size: int,
           max_tokens_per_microbatch: int | None = None, pack_sequences: bool = False, share_prompt: bool = False):
    """Critic values of the state before each label position [B, L-1]. (Value heads read every
    position, so ``share_prompt``, a policy-side saving, does not apply.)"""
    return _forward(key, batch, micro_batch_size, lambda v, mb: _per_label(_positions(v, mb)[:, :-1, 0], mb).float(),
                    max_tokens_per_microbatch, pack_sequences)


def scores(key: str, batch: RankBatch | dict[str, Any], micro_batch_size: int,
           max_tokens_per_microbatch: int | None = None, pack_sequences: bool = False, share_prompt: bool = False):
    """Reward-model score of each sequence [B]: the value head at its last token."""
    def head(v, mb):
        return _positions(v, mb)[mb["seq_row"], mb["seq_start"] + mb["seq_lens"] - 1, 0].float()

    return _forward(key, batch, micro_batch_size, head, max_tokens_per_microbatch, pack_sequences)


# --- updates ------------------------------------------------------------------------------


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


# loss-function outputs under this prefix are per-token tensors [b, T], not metrics to sum
PER_TOKEN = "per_token/"
# what every optimizer step reports besides its loss's metrics
STEP_METRICS = (Metric("grad_norm", "same"), Metric("lr", "same"), Metric("skipped", "same"))


def _update(key: str, batch: RankBatch | dict[str, Any], optim: OptimizerConfig, micro_batch_size: int,
            minibatches: int, epochs: int, loss_fn, max_tokens: int | None, pack: bool, select: bool = False,
            share: bool = False, metrics: tuple[Metric, ...] = ()) -> dict[str, Any] | None:
    """``epochs`` passes over ``minibatches`` optimizer steps on this rank's shard.

    Returns ``{"steps": [metrics of each optimizer step], "per_token": (dp_rank, {name: [n, L-1]})
    or None, "reduce": {metric: how shards combine it}}``: per-token outputs of the loss
    (``PER_TOKEN`` keys) come back, in the shard's order, when one step covers the whole shard once
    (then they are the pre-update model's). Every metric the loss emits must be in ``metrics``.
    """
    from megarl.models.forward import rows_forward
    from megarl.models.train import train_step

    model = held(key)
    ensure_optimizer(model, optim)
    shard = _shard(model, batch)
    n = shard["tokens"].shape[0]
    if n % minibatches:
        raise ValueError(f"{n} sequences per data-parallel rank do not split into {minibatches} minibatches")
    size = n // minibatches
    reduce = {m.name: m.reduce for m in STEP_METRICS + metrics}
    per_step, per_token = [], None
    for _ in range(epochs):
        for m in range(minibatches):
            part = {k: (v[m * size:(m + 1) * size] if isinstance(v, torch.Tensor) and v.dim() > 0 else v)
                    for k, v in shard.items()}
            part["denom"] = shard["denoms"][m]
            mbs = _microbatches(model, part, micro_batch_size, max_tokens, pack, select, share)
            for mb in mbs:
                # megatron divides each micro-batch's loss by this rank's number of micro-batches
                # (which may differ between ranks under a token budget) and DDP averages over
                # data-parallel ranks; the losses use a global denominator, so undo both.
                mb["scale"] = len(mbs) * model.info.dp
            lr = _set_lr(model, optim)
            result = train_step(model.chunks, model.optimizer, mbs, loss_fn,
                                lambda chunk, mb: rows_forward(chunk, mb["inputs"]))
            model.extra["optimizer_steps"] += 1
            step = {"grad_norm": float(result["grad_norm"] or 0.0), "lr": lr, "skipped": float(not result["updated"])}
            for name, value in result["moe"].items():  # equal on every rank after the tracker's reduction
                step[f"moe/{name}"] = value
                reduce[f"moe/{name}"] = "same"
            if result["metrics"]:
                tensors = [{k.removeprefix(PER_TOKEN): r.pop(k) for k in list(r) if k.startswith(PER_TOKEN)}
                           for r in result["metrics"]]
                if tensors[0] and epochs == minibatches == 1:
                    per_token = (model.info.dp_rank, _scatter(tensors, mbs, n, shard["tokens"].shape[1]))
                for name in result["metrics"][0]:
                    if name not in reduce:
                        raise ValueError(f"the loss emits the metric {name!r} but does not declare it "
                                         "(megarl.algorithms.base.Metric), so the driver cannot combine it")
                    step[name] = combine([float(r[name]) for r in result["metrics"]], reduce[name])
            per_step.append(step)
    if not _reporting(model):
        return None
    return {"steps": per_step, "per_token": per_token, "reduce": {name: reduce[name] for name in per_step[0]}}


def train_policy(key: str, batch: RankBatch | dict[str, Any], algo: AlgorithmConfig, optim: OptimizerConfig,
                 micro_batch_size: int, max_tokens_per_microbatch: int | None = None, pack_sequences: bool = False,
                 share_prompt: bool = False):
    """The policy updates of ``algo``'s algorithm (its ``loss`` on each micro-batch) on ``batch``;
    see ``_update``.

    Without ``batch["old_logprobs"]`` the update is on-policy (one epoch, one minibatch): the
    behaviour policy is the model as it is, so the ratio is ``exp(lp - lp.detach())`` (1, with
    the policy gradient) and no separate scoring pass is needed. The log-probs and entropy of
    that forward come back per token instead, at the positions of ``select_mask``, for the
    step's metrics."""
    from megarl.models.forward import rows_output

    cfg = algo
    algorithm = get_algorithm(cfg.name)
    vocab = held(key).spec.arch.vocab_size
    on_policy = "old_logprobs" not in _plain(batch)
    if on_policy and (cfg.ppo_epochs != 1 or cfg.minibatches != 1):
        raise ValueError(f"no old_logprobs: an update of {cfg.ppo_epochs} epoch(s) x {cfg.minibatches} "
                         "minibatch(es) is off-policy after its first step and needs them")

    def loss_fn(output, mb):
        logits = rows_output(output, mb["inputs"])
        ent = None
        if cfg.entropy_coef > 0 or on_policy:
            lp, ent = _label_stats(logits, mb, vocab, entropy=True)
        else:
            lp = _label_stats(logits, mb, vocab)
        # norm_len: "seq-mean-token-sum"'s constant divisor (Dr.GRPO), from the driver's denominators()
        step = PolicyMicroBatch(logprobs=lp, old_logprobs=lp.detach() if on_policy else mb["old_logprobs"],
                                advantages=mb["advantages"], mask=mb["mask"], denom=mb["denom"],
                                norm_len=mb.get("norm_len"), ref_logprobs=mb.get("ref_logprobs"), entropy=ent,
                                rollout_logprobs=mb.get("rollout_logprobs"))
        loss, out = algorithm.loss(cfg, step)
        if on_policy:
            out |= {f"{PER_TOKEN}logprobs": lp.detach().float(), f"{PER_TOKEN}entropy": ent.detach().float()}
        return loss * mb["scale"], out

    return _update(key, batch, optim, micro_batch_size, cfg.minibatches, cfg.ppo_epochs, loss_fn,
                   max_tokens_per_microbatch, pack_sequences, select=True, share=share_prompt,
                   metrics=algorithm.loss_metrics())


def train_value(key: str, batch: RankBatch | dict[str, Any], algo: AlgorithmConfig, optim: OptimizerConfig,
                micro_batch_size: int, max_tokens_per_microbatch: int | None = None, pack_sequences: bool = False,
                share_prompt: bool = False):
    """The critic's clipped value-loss updates towards ``batch["returns"]`` (``Algorithm.value_loss``)."""
    from megarl.models.forward import rows_output

    cfg = algo
    algorithm = get_algorithm(cfg.name)

    def loss_fn(output, mb):
        values = _per_label(_positions(rows_output(output, mb["inputs"]), mb)[:, :-1, 0], mb).float()
        step = ValueMicroBatch(values=values, old_values=mb["old_values"], returns=mb["returns"], mask=mb["mask"],
                               denom=mb["denom"], norm_len=mb.get("norm_len"))
        loss, out = algorithm.value_loss(cfg, step)
        return loss * mb["scale"], out

    return _update(key, batch, optim, micro_batch_size, cfg.minibatches, cfg.ppo_epochs, loss_fn,
                   max_tokens_per_microbatch, pack_sequences, metrics=VALUE_METRICS)
