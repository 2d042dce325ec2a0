"""A rank's shard of a ``RankBatch`` cut into micro-batches, and per-sequence results put back in order.

A micro-batch is rows of tokens the model runs on: fixed ``micro_batch_size`` rows of the padded
batch, or (token budget, packing) rows cut to their longest sequence or packed, or consecutive
samples of one prompt sharing a copy of it (``megarl.data.batching``). It also says where each
of its sequences sits in those rows, and holds the batch's per-sequence fields for them, token-level
ones cut to its ``T`` label positions: what the losses read (``megarl.workers.label_stats`` reads
the model's outputs at those positions).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megarl.data.batching import MicroBatchPlan, plan_microbatches, plan_shared_prompts
from megarl.models.context_parallel import CpSplit, sequence_multiple
from megarl.models.forward import RowsInputs, rows_inputs
from megarl.platform import current_platform
from megarl.workers.megatron_model import HeldModel
from megarl.workers.rank_batch import SEQUENCE_FIELDS, RankBatch, placeholder_routes
from megarl.workers.rank_results import TokenStats


@dataclass
class MicroBatch:
    """One micro-batch of ``b`` sequences, ``T`` label positions wide (its longest sequence's)."""

    # -- the rows the model runs on ---------------------------------------------------------------
    plan: MicroBatchPlan
    tokens: torch.Tensor  # [rows, width]
    inputs: RowsInputs  # the model's input (this rank's share under context parallelism)
    # -- where its sequences sit ------------------------------------------------------------------
    index: torch.Tensor  # [b] each sequence's row in the shard
    gather: torch.Tensor  # [b, T] each label position's flat index into rows x (width - 1)
    valid: torch.Tensor  # [b, T] False past a sequence's end
    seq_row: torch.Tensor  # [b] the row each sequence is in
    seq_start: torch.Tensor  # [b] and its first column there
    # -- the batch's fields for its sequences (``RankBatch``'s, cut: [b] or [b, T]) ----------------
    mask: torch.Tensor
    seq_lens: torch.Tensor | None = None
    temperature: float = 1.0
    advantages: torch.Tensor | None = None
    old_logprobs: torch.Tensor | None = None
    select_mask: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    rollout_logprobs: torch.Tensor | None = None
    old_values: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    margin: torch.Tensor | None = None
    desirable: torch.Tensor | None = None
    norm_len: float | None = None
    denom: float | None = None  # an update's: its minibatch's global loss normaliser
    # -- response-only forwards (``select``): the label positions computed ---------------------------
    cp_keep: torch.Tensor | None = None  # [b, T] under context parallelism: the positions kept
    selected_labels: torch.Tensor | None = None  # [n] the next token at each selected position
    selected_at: torch.Tensor | None = None  # [n] where each selected result goes in [b * T]
    selected_zero: bool = False  # nothing needed: the one position computed is zeroed

    @property
    def responses(self) -> torch.Tensor:
        return responses(self.mask, self.select_mask)


def responses(mask: torch.Tensor, select_mask: torch.Tensor | None) -> torch.Tensor:
    """[n, T] bool: the label positions of response tokens whose log-probs the step needs
    (``select_mask`` when the batch has one: every response, for the metrics; else ``mask``)."""
    return (mask if select_mask is None else select_mask) != 0


def _lengths(shard: RankBatch, width: int) -> list[int]:
    """Tokens of each sequence that matter: ``seq_lens`` when the batch has it, else up to
    the last response token of ``mask`` (later tokens feed no loss term). At least 2 (one
    label position), at most the padded width."""
    if shard.seq_lens is not None:
        lengths = shard.seq_lens
    else:
        positions = torch.arange(1, width, device=shard.mask.device)
        lengths = ((shard.mask != 0) * positions).amax(dim=1) + 1
    return [int(n) for n in lengths.clamp(min=2, max=width)]


def microbatches(model: HeldModel, shard: RankBatch, micro_batch_size: int, max_tokens: int | None = None,
                 pack: bool = False, select: bool = False, share: bool = False,
                 denom: float | None = None) -> list[MicroBatch]:
    """This shard's micro-batches: fixed ``micro_batch_size`` rows of the padded batch, or (token
    budget / packing) rows cut to their longest sequence or packed; see ``plan_microbatches``.
    With ``select``, the model projects onto the vocabulary only at the response label
    positions (``_select_labels``); with ``select`` and ``share`` as well, consecutive samples of
    one prompt share a single copy of it (``plan_shared_prompts``). ``denom``: an update's
    minibatch normaliser, which every micro-batch carries.
    """
    tokens = shard.tokens
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
        cut = {}
        for name in SEQUENCE_FIELDS:
            if (value := getattr(shard, name)) is not None:
                cut[name] = (value[index, :labels] if value.dim() >= 2 and value.shape[1] == width - 1
                             else value[index]).to(device)
        rows = rows.to(device)
        inputs = rows_inputs(rows, plan)
        if shard.routes is not None:  # rollout routing replay: each token's experts, laid out as its token
            routes, route_valid = _rows_routes(shard.routes, plan, _lengths(shard, width))
            inputs.routes, inputs.route_valid = routes.to(device), route_valid.to(device)
        mb = MicroBatch(plan=plan, tokens=rows, inputs=inputs, index=index.to(device), gather=gather.to(device),
                        valid=valid.to(device), seq_row=torch.tensor(plan.row).to(device),
                        seq_start=torch.tensor(plan.start).to(device), temperature=shard.temperature,
                        norm_len=shard.norm_len, denom=denom, **cut)
        if par.cp > 1:  # every position stays: each rank computes its share of them
            mb.inputs = inputs.cp_share(CpSplit(par.cp, model.info.cp_rank, plan.width))
            if select:  # the results outside the selection are 0, as when selected
                mb.cp_keep = mb.valid & mb.responses
        elif select:
            _select_labels(mb, tokens[index, 1:labels + 1].to(device))
        out.append(mb)
    return out


def _rows_routes(routes: torch.Tensor, plan: MicroBatchPlan, lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
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


def _prompt_lens(shard: RankBatch, lengths: list[int]) -> list[int]:
    """Each sequence's prompt length: up to its first response label position (``responses``);
    a sequence without one counts as all prompt but its last token, so it shares only with an
    identical sequence."""
    mask = responses(shard.mask, shard.select_mask)
    first = mask.float().argmax(dim=1)
    return [int(f) + 1 if m else n - 1 for f, m, n in zip(first, mask.any(dim=1), lengths, strict=True)]


def _select_labels(mb: MicroBatch, labels: torch.Tensor) -> None:
    """Marks the label positions whose log-probs the step needs (``responses``). The model then
    computes logits there only; the results come back at the same [b, T] places, 0 elsewhere
    (see ``label_stats``). ``labels`` [b, T] are each sequence's next tokens (a shared prompt's
    last column has several)."""
    keep = mb.valid & mb.responses
    if not keep.any():  # nothing needed: compute one position (shared rows have no other path) and zero it
        keep = torch.zeros_like(keep)
        keep[0, 0] = True
        mb.selected_zero = True
    flat = mb.gather[keep]  # into rows x (width - 1) label positions
    width = mb.plan.width
    mb.inputs.select = flat // (width - 1) * width + flat % (width - 1)  # into rows x width
    mb.selected_labels = labels[keep]
    mb.selected_at = keep.reshape(-1).nonzero().squeeze(1)


def scatter(parts: list[torch.Tensor], mbs: list[MicroBatch], n: int, width: int) -> torch.Tensor:
    """Per-micro-batch results ([b, T] or [b]) back into the shard's order, [n, L-1] or [n]."""
    first = parts[0]
    shape = (n, width - 1) if first.dim() == 2 else (n,)
    out = torch.zeros(shape, dtype=first.dtype)
    for part, mb in zip(parts, mbs, strict=True):
        index = mb.index.cpu()
        if part.dim() == 2:
            out[index, :part.shape[1]] = part.cpu()
        else:
            out[index] = part.cpu()
    return out


def scatter_stats(parts: list[TokenStats], mbs: list[MicroBatch], n: int, width: int) -> TokenStats:
    """``scatter`` of per-micro-batch log-probs and entropies."""
    logprobs = scatter([p.logprobs for p in parts], mbs, n, width)
    entropy = None if parts[0].entropy is None else scatter([p.entropy for p in parts], mbs, n, width)
    return TokenStats(logprobs, entropy)
