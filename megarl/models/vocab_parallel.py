"""Chunked, low-memory log-softmax statistics over vocab-parallel logits.

Each tensor-parallel rank holds a slice [..., vocab/tp] of the logits. The full
log-softmax would need the whole vocabulary on one rank, and even a rank-local
``log_softmax`` allocates a second logits-sized tensor (plus more for entropy and
for backward). Here the logits are read a chunk of rows at a time, so the working
memory beyond the logits is a few chunk-sized buffers plus O(tokens) statistics:

- forward, pass 1: per-token max over the real (unpadded) vocabulary, all-reduced (MAX);
- forward, pass 2: per-token sum(exp(x - max)) (and for entropy sum(exp(x - max) * (x - max))),
  plus the label's logit on the rank that owns it, all-reduced (SUM) in one call;
- backward: the softmax is recomputed chunk by chunk from the saved logits and the
  per-token log-normaliser, written straight into the gradient buffer.

One autograd Function computes log-probs and/or entropy; it saves only the logits (which
the caller holds anyway) and per-token vectors, and its backward writes one gradient
buffer whichever outputs were used. Rows are walked through views, never ``reshape``
copies, so a non-contiguous slice such as ``logits[:, :-1]`` is read in place (its
gradient still costs autograd a logits-sized buffer: ``drop_last`` avoids the slice).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

# Bytes of one float32 working buffer per chunk (forward uses up to two, backward one).
# Tens to hundreds of rows at 50k-150k vocabularies: enough work per kernel that the
# per-chunk overhead is small, while the buffers stay small next to the logits.
DEFAULT_CHUNK_BYTES = 16 * 2**20


@dataclass(frozen=True)
class VocabShard:
    """Which slice of the (padded) vocabulary this rank's logits hold, and the group to reduce over."""

    start: int  # first vocabulary id of this rank's slice
    real: int  # how many of the slice's columns are real ids (the rest is padding), 0..width
    group: dist.ProcessGroup | None  # None: the slice is the whole vocabulary, nothing to reduce
    chunk_rows: int  # rows per chunk


def vocab_shard(width: int, vocab_size: int, chunk_rows: int | None = None) -> VocabShard:
    """This rank's shard of a vocabulary split over megatron's tensor-parallel group.

    Without initialised megatron parallel state (a single process) the slice is rank 0 of 1.
    """
    from megatron.core import parallel_state as ps

    tp, rank, group = 1, 0, None
    if ps.model_parallel_is_initialized():
        tp = ps.get_tensor_model_parallel_world_size()
        rank = ps.get_tensor_model_parallel_rank()
        group = ps.get_tensor_model_parallel_group() if tp > 1 else None
    if width * tp < vocab_size:
        raise ValueError(f"logits hold {width} x tp={tp} columns, fewer than vocab_size={vocab_size}")
    start = rank * width
    real = min(max(vocab_size - start, 0), width)
    rows = chunk_rows or max(1, DEFAULT_CHUNK_BYTES // (4 * width))
    return VocabShard(start=start, real=real, group=group, chunk_rows=rows)


def _row_blocks(*xs: torch.Tensor) -> Iterator[tuple[torch.Tensor, ...]]:
    """2-D views [rows, width] of same-shaped tensors that cover their leading dims in row-major order.

    ``x.view(-1, width)`` when every tensor's strides allow it; otherwise the first dim is
    walked one index at a time (e.g. ``logits[:, :-1]`` yields one view per sequence).
    """
    if xs[0].dim() == 1:
        yield tuple(x.unsqueeze(0) for x in xs)
        return
    try:
        yield tuple(x.view(-1, x.shape[-1]) for x in xs)
    except RuntimeError:
        for i in range(xs[0].shape[0]):
            yield from _row_blocks(*(x[i] for x in xs))


def _chunks(rows: int, *xs: torch.Tensor) -> Iterator[tuple[slice, tuple[torch.Tensor, ...]]]:
    """(flat row range, 2-D views of up to ``rows`` rows of each tensor) over all rows."""
    offset = 0
    for blocks in _row_blocks(*xs):
        n = blocks[0].shape[0]
        for begin in range(0, n, rows):
            end = min(begin + rows, n)
            yield slice(offset + begin, offset + end), tuple(b[begin:end] for b in blocks)
        offset += n


def _real_fp32(chunk: torch.Tensor, shard: VocabShard) -> torch.Tensor:
    """The chunk's real-vocabulary columns in float32 (a view when already float32)."""
    return chunk[:, :shard.real].float()


def _all_reduce(t: torch.Tensor, shard: VocabShard, op: dist.ReduceOp.RedOpType) -> None:
    if shard.group is not None:
        dist.all_reduce(t, op=op, group=shard.group)


def _row_max(logits: torch.Tensor, shard: VocabShard, n: int) -> torch.Tensor:
    """Per-token max over the whole real vocabulary [n] (float32)."""
    # A rank whose slice is all padding contributes the float32 minimum, not -inf, so the
    # MAX all-reduce stays finite.
    row_max = torch.full((n,), torch.finfo(torch.float32).min, device=logits.device)
    if shard.real:
        for rows, (chunk,) in _chunks(shard.chunk_rows, logits):
            row_max[rows] = chunk[:, :shard.real].amax(dim=-1).float()
    _all_reduce(row_max, shard, dist.ReduceOp.MAX)
    return row_max


def _sums(logits: torch.Tensor, shard: VocabShard, row_max: torch.Tensor, local_labels: torch.Tensor | None,
          entropy: bool) -> torch.Tensor:
    """All-reduced per-token rows [3, n]: sum exp(x - max); sum exp(x - max) * (x - max); label logit."""
    n = row_max.shape[0]
    sums = torch.zeros(3, n, device=row_max.device)
    if shard.real:
        if local_labels is not None:
            # The label's logit on the rank that owns it, 0 elsewhere: the SUM delivers it everywhere.
            index = local_labels.clamp(0, shard.real - 1).unsqueeze(-1)
        for rows, (chunk,) in _chunks(shard.chunk_rows, logits):
            if local_labels is not None:
                sums[2, rows] = chunk.gather(-1, index[rows]).squeeze(-1).float()
            shifted = _real_fp32(chunk, shard) - row_max[rows, None]  # a chunk-sized buffer
            if entropy:
                exp = shifted.exp()  # and a second one
                sums[0, rows] = exp.sum(dim=-1)
                sums[1, rows] = exp.mul_(shifted).sum(dim=-1)
                del exp
            else:
                sums[0, rows] = shifted.exp_().sum(dim=-1)
            del shifted
        if local_labels is not None:
            sums[2].masked_fill_((local_labels < 0) | (local_labels >= shard.real), 0.0)
    _all_reduce(sums, shard, dist.ReduceOp.SUM)
    return sums


class _LogprobEntropy(torch.autograd.Function):
    """(log p(labels), entropy) [n] from logits rows; either may be skipped (labels None / entropy False).

    ``drop_last``: the logits are [..., s, width] and the results are for positions [..., :s-1]
    (next-token prediction), without the slice that would make autograd build a
    logits-sized zero gradient of its own.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, local_labels: torch.Tensor | None, shard: VocabShard, entropy: bool,
                drop_last: bool):
        x = logits[..., :-1, :] if drop_last else logits
        n = x[..., 0].numel()
        row_max = _row_max(x, shard, n)
        sums = _sums(x, shard, row_max, local_labels, entropy)
        log_sum = sums[0].log()
        log_norm = row_max + log_sum  # log Z
        logprob = sums[2] - log_norm if local_labels is not None else None
        mean_logit = row_max + sums[1] / sums[0] if entropy else None  # E_p[x]
        ctx.save_for_backward(logits, local_labels, log_norm, mean_logit)
        ctx.shard, ctx.drop_last = shard, drop_last
        ctx.set_materialize_grads(False)  # an unused output's gradient arrives as None
        # H = log Z - E_p[x], computed from the shifted sums for precision
        ent = log_sum - sums[1] / sums[0] if entropy else None
        return logprob, ent

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_logprob: torch.Tensor | None, grad_entropy: torch.Tensor | None):
        logits, local_labels, log_norm, mean_logit = ctx.saved_tensors
        shard: VocabShard = ctx.shard
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        if ctx.drop_last:
            grad[..., -1, :] = 0
        x, g = (logits[..., :-1, :], grad[..., :-1, :]) if ctx.drop_last else (logits, grad)
        if local_labels is not None and grad_logprob is not None:
            gl = grad_logprob.float()
            owned = (local_labels >= 0) & (local_labels < shard.real)
        else:
            gl = None
        ge = grad_entropy.float() if mean_logit is not None and grad_entropy is not None else None
        for rows, (chunk, dest) in _chunks(shard.chunk_rows, x, g):
            with _fp32_target(dest) as target:
                probs = _softmax_into(target, chunk, log_norm[rows], shard)
                if ge is not None:
                    # dH/dx = -p (x - E_p[x])
                    weight = _real_fp32(chunk, shard) - mean_logit[rows, None]
                    weight.mul_(-ge[rows, None])
                    if gl is not None:
                        weight.sub_(gl[rows, None])  # d log p(label)/dx = onehot - p
                    probs.mul_(weight)
                    del weight
                elif gl is not None:
                    probs.mul_(-gl[rows, None])
                else:
                    probs.zero_()
                if gl is not None:
                    hit = owned[rows].nonzero().squeeze(-1)
                    target[hit, local_labels[rows][hit]] += gl[rows][hit]
        return grad, None, None, None, None


def _softmax_into(out: torch.Tensor, chunk: torch.Tensor, log_norm: torch.Tensor, shard: VocabShard) -> torch.Tensor:
    """Writes softmax probabilities of ``chunk`` into ``out`` (same shape); returns the real columns."""
    out[:, shard.real:] = 0
    real = out[:, :shard.real]
    real.copy_(chunk[:, :shard.real])
    real.sub_(log_norm[:, None]).exp_()
    return real


class _fp32_target:
    """Context giving a float32 view of ``dest`` to compute into; copies back on exit when dest is not float32."""

    def __init__(self, dest: torch.Tensor):
        self.dest = dest
        self.work = dest if dest.dtype == torch.float32 else torch.empty(dest.shape, device=dest.device)

    def __enter__(self) -> torch.Tensor:
        return self.work

    def __exit__(self, *exc: object) -> None:
        if self.work is not self.dest and exc[0] is None:
            self.dest.copy_(self.work)


def vocab_parallel_stats(logits: torch.Tensor, labels: torch.Tensor | None, vocab_size: int, entropy: bool,
                         drop_last: bool = False, chunk_rows: int | None = None
                         ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(log p(labels) or None, entropy or None) in float32 from TP-local logits [..., vocab/tp].

    Differentiable w.r.t. ``logits`` (one gradient buffer however many outputs are used).
    With ``drop_last`` the logits are [..., s, vocab/tp] and the results cover positions
    [..., :s-1] (labels [..., s-1]); the last position's gradient is 0.
    """
    lead = logits.shape[:-2] + (logits.shape[-2] - 1,) if drop_last else logits.shape[:-1]
    if drop_last and logits.dim() < 2:
        raise ValueError("drop_last needs logits with a sequence dim [..., s, vocab]")
    if labels is not None and labels.shape != lead:
        raise ValueError(f"labels {tuple(labels.shape)} do not match the logits' positions {tuple(lead)}")
    shard = vocab_shard(logits.shape[-1], vocab_size, chunk_rows)
    local = (labels.reshape(-1) - shard.start) if labels is not None else None
    lp, ent = _LogprobEntropy.apply(logits, local, shard, entropy, drop_last)
    return (lp.view(lead) if lp is not None else None), (ent.view(lead) if ent is not None else None)


def vocab_parallel_logprobs(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int,
                            chunk_rows: int | None = None) -> torch.Tensor:
    """log p(labels) [...] in float32 from TP-local logits [..., vocab/tp]; differentiable, low memory."""
    return vocab_parallel_stats(logits, labels, vocab_size, entropy=False, chunk_rows=chunk_rows)[0]


def vocab_parallel_entropy(logits: torch.Tensor, vocab_size: int, chunk_rows: int | None = None) -> torch.Tensor:
    """Entropy [...] in float32 of the softmax over the real vocabulary; differentiable, low memory."""
    return vocab_parallel_stats(logits, None, vocab_size, entropy=True, chunk_rows=chunk_rows)[1]
