"""Micro-batching by token budget, sequence packing, and right padding.

All three are pure functions of their inputs (no randomness, ties broken by index),
so every data-parallel rank that sees the same lengths builds the same batches.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch


def _check_lengths(lengths: Sequence[int], limit: int, limit_name: str, what: str) -> None:
    if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
        raise ValueError(f"{limit_name} must be a positive integer, got {limit!r}")
    for index, length in enumerate(lengths):
        if not isinstance(length, int) or isinstance(length, bool) or length < 0:
            raise ValueError(f"{what} {index}: length must be a non-negative integer, got {length!r}")
        if length > limit:
            raise ValueError(f"{what} {index} has {length} tokens > {limit_name} {limit}")


def token_budget_microbatches(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Groups sample indices so that each group's padded size, ``len(group) * max(length)``,
    is at most ``max_tokens``; every index appears exactly once.

    Samples are taken longest first (ties: lower index first) and a group is closed
    when the next sample would break the budget. Sorting puts similar lengths together,
    so little of the budget is padding; longest first puts the biggest micro-batch
    first, so an out-of-memory shows on the first step, not hours in.
    """
    _check_lengths(lengths, max_tokens, "max_tokens", "sample")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    groups: list[list[int]] = []
    current: list[int] = []
    for index in order:
        # Descending order: the group's max length is its first member's.
        longest = lengths[current[0]] if current else lengths[index]
        if current and (len(current) + 1) * longest > max_tokens:
            groups.append(current)
            current = []
        current.append(index)
    if current:
        groups.append(current)
    return groups


@dataclass
class PackedRows:
    """Sequences packed end to end into rows of at most ``max_len`` tokens (unpadded).

    ``cu_seqlens[r]`` are row ``r``'s sequence boundaries, ``[0, l1, l1+l2, ...]`` (the
    cumulative lengths a THD / varlen attention kernel takes); ``seq_index[r][k]`` is
    the input index of the ``k``-th sequence in row ``r``.
    """

    tokens: list[list[int]]
    cu_seqlens: list[list[int]]
    seq_index: list[list[int]]
    max_len: int

    def position_ids(self) -> list[list[int]]:
        """Positions restart at 0 for every packed sequence (RoPE sees each one alone)."""
        return [[p for start, end in zip(cu, cu[1:], strict=False) for p in range(end - start)]
                for cu in self.cu_seqlens]

    def unpack(self) -> list[list[int]]:
        """The input sequences, in input order."""
        out: list[list[int]] = [[] for _ in range(sum(len(indices) for indices in self.seq_index))]
        for row, cu, indices in zip(self.tokens, self.cu_seqlens, self.seq_index, strict=True):
            for k, index in enumerate(indices):
                out[index] = row[cu[k]:cu[k + 1]]
        return out


def first_fit_decreasing(lengths: Sequence[int], max_len: int) -> list[list[int]]:
    """Rows of input indices, each summing to at most ``max_len`` tokens: longest first
    (ties by index), each into the first row with room, a new row when none has."""
    _check_lengths(lengths, max_len, "max_len", "sequence")
    empty = [i for i, length in enumerate(lengths) if length == 0]
    if empty:
        raise ValueError(f"sequence {empty[0]} is empty; packing needs at least one token per sequence")
    rows: list[list[int]] = []
    fill: list[int] = []
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        r = next((r for r, used in enumerate(fill) if used + lengths[index] <= max_len), None)
        if r is None:
            r = len(rows)
            rows.append([])
            fill.append(0)
        rows[r].append(index)
        fill[r] += lengths[index]
    return rows


def pack_sequences(seqs: Sequence[Sequence[int]], max_len: int) -> PackedRows:
    """First-fit decreasing (see ``first_fit_decreasing``). Rows hold at most ``max_len``
    tokens; a sequence longer than ``max_len`` is an error (splitting it would change its
    meaning), and so is an empty one (a zero-length segment breaks varlen kernels).
    """
    seq_index = first_fit_decreasing([len(seq) for seq in seqs], max_len)
    rows = [[token for index in indices for token in seqs[index]] for indices in seq_index]
    cu_seqlens = [[0, *itertools.accumulate(len(seqs[index]) for index in indices)] for indices in seq_index]
    return PackedRows(tokens=rows, cu_seqlens=cu_seqlens, seq_index=seq_index, max_len=max_len)


def pad_right(seqs: Sequence[Sequence[int]], pad_id: int,
              pad_to: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tokens [B, T] int64, mask [B, T] bool)``; ``T`` is the longest sequence, or
    ``pad_to`` when given (e.g. a multiple the kernels want); mask is True on real tokens."""
    if not seqs:
        raise ValueError("pad_right needs at least one sequence")
    longest = max(len(seq) for seq in seqs)
    width = longest if pad_to is None else pad_to
    if width < longest:
        raise ValueError(f"pad_to {pad_to} is shorter than the longest sequence ({longest} tokens)")
    tokens = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.bool)
    for row, seq in enumerate(seqs):
        if seq:
            tokens[row, :len(seq)] = torch.as_tensor(list(seq), dtype=torch.long)
            mask[row, :len(seq)] = True
    return tokens, mask


# --- micro-batch plans for the model's forward/backward ------------------------------------


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclass(frozen=True)
class MicroBatchPlan:
    """Where each sequence of one micro-batch sits in the model's input, ``[rows, width]``.

    Sequence ``k`` of the micro-batch is input sequence ``index[k]``; its ``length[k]``
    tokens start at column ``start[k]`` of row ``row[k]``. A row holds one sequence
    (right-padded) or several packed end to end; columns past a row's last sequence are
    padding, which no sequence attends to (it comes after them, and attention is causal).
    """

    index: list[int]
    row: list[int]
    start: list[int]
    length: list[int]
    rows: int
    width: int
    # Shared prompts (``plan_shared_prompts``): sequence k's first ``shared[k]`` tokens are the
    # prompt written once at column ``prefix_start[k]`` of its row, and ``start[k]`` is where its
    # own tokens (the response) begin. None: every sequence is contiguous from ``start[k]``.
    shared: list[int] | None = None
    prefix_start: list[int] | None = None

    @property
    def packed(self) -> bool:
        """More than one sequence shares a row: attention needs a block-diagonal mask."""
        return len(set(self.row)) < len(self.row)

    def columns(self, k: int) -> torch.Tensor:
        """The column of each of sequence ``k``'s tokens in its row, ``[length[k]]``."""
        shared = self.shared[k] if self.shared else 0
        own = torch.arange(self.length[k] - shared) + self.start[k]
        if not shared:
            return own
        return torch.cat([torch.arange(shared) + self.prefix_start[k], own])

    def layout(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(positions, segment, prefix)``, each ``[rows, width]`` long: each column's position
        within its sequence, the span it belongs to (a sequence's own tokens, a shared prompt,
        or a row's padding tail), and the span it may attend to besides its own (its prompt,
        else itself). Attention from column q to column k <= q is allowed when
        ``segment[k] in (segment[q], prefix[q])``."""
        positions = torch.zeros(self.rows, self.width, dtype=torch.long)
        segment = torch.full((self.rows, self.width), -1, dtype=torch.long)
        segment += -torch.arange(self.rows).unsqueeze(1)  # each row's padding tail: its own negative id
        prefix = segment.clone()
        prompts: dict[tuple[int, int], int] = {}
        for k, r in enumerate(self.row):
            shared = self.shared[k] if self.shared else 0
            columns = self.columns(k)
            positions[r, columns] = torch.arange(self.length[k])
            own_id = len(self.row) + k  # prompt ids count from 0 and there are fewer than len(row)
            segment[r, columns[shared:]] = own_id
            attends = own_id
            if shared:
                attends = prompts.setdefault((r, self.prefix_start[k]), len(prompts))
                segment[r, columns[:shared]] = attends
                prefix[r, columns[:shared]] = attends
            prefix[r, columns[shared:]] = attends
        return positions, segment, prefix

    @property
    def label_width(self) -> int:
        """Label positions of the longest sequence (predictions of its tokens 1..n-1)."""
        return max(self.length) - 1

    def segments(self) -> list[list[int]]:
        """Per row, the boundaries ``[0, l1, l1+l2, ..., width]`` of its sequences; a padding
        tail is a segment of its own (what a varlen / THD attention kernel takes)."""
        if self.shared:
            raise ValueError("rows with shared prompts need an attention mask, not varlen segments")
        bounds: list[list[int]] = [[0] for _ in range(self.rows)]
        for k in sorted(range(len(self.index)), key=lambda k: (self.row[k], self.start[k])):
            bounds[self.row[k]].append(self.start[k] + self.length[k])
        return [b if b[-1] == self.width else [*b, self.width] for b in bounds]

    def label_gather(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(index [b, label_width] long, valid [b, label_width] bool)``.

        ``index`` points into per-position outputs of the rows flattened to
        ``[rows * (width - 1)]`` (positions 0..width-2: the predictions of the next token),
        so ``flat[index]`` is each sequence's own ``[label_width]`` row, aligned with its
        unpacked label positions. Positions past a sequence's end are not ``valid`` and
        point at position 0 (in range, so they can be gathered, and then ignored); no
        valid position reads across a sequence boundary.
        """
        k = torch.arange(self.label_width)
        length = torch.tensor(self.length).unsqueeze(1)
        valid = k.unsqueeze(0) < length - 1
        if self.shared:  # a sequence's label positions are its token columns but the last
            index = torch.zeros(len(self.index), self.label_width, dtype=torch.long)
            for s in range(len(self.index)):
                index[s, :self.length[s] - 1] = self.row[s] * (self.width - 1) + self.columns(s)[:-1]
            return index, valid
        base = (torch.tensor(self.row) * (self.width - 1) + torch.tensor(self.start)).unsqueeze(1)
        return torch.where(valid, base + k, torch.zeros((), dtype=torch.long)), valid


def plan_microbatches(lengths: Sequence[int], width: int, micro_batch_size: int,
                      max_tokens: int | None = None, pack: bool = False,
                      multiple: int = 1) -> list[MicroBatchPlan]:
    """Splits sequences of ``lengths`` tokens (right-padded to ``width``) into micro-batches.

    - neither option: ``micro_batch_size`` consecutive sequences per micro-batch, each
      ``[micro_batch_size, width]`` as given (today's fixed shapes; the width rounded up to ``multiple``);
    - ``max_tokens``: ``token_budget_microbatches`` groups, each cut to its longest
      sequence (rounded up to ``multiple``), so ``rows x width <= max_tokens`` up to rounding;
    - ``pack``: sequences packed end to end (``first_fit_decreasing``), with ``max_tokens``
      into one row of at most ``max_tokens`` per micro-batch; without, into rows as long as
      the longest sequence, ``micro_batch_size`` rows per micro-batch; each cut to its
      fullest row. (Local attention on CPU materialises ``width x width`` scores per head,
      so there a long packed row costs more attention than the padded rows it replaces.)

    ``multiple`` is what the sequence dimension must divide by
    (``models.context_parallel.sequence_multiple``: the TP size under sequence parallelism, times
    2 x CP under context parallelism). Deterministic in its inputs, so every rank of a shard
    builds the same plan.
    """
    n = len(lengths)
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
    _check_lengths(lengths, width, "width", "sequence")
    if max_tokens is None and not pack:
        if n % micro_batch_size:
            raise ValueError(f"{n} sequences per data-parallel rank are not a multiple of "
                             f"micro_batch_size={micro_batch_size}")
        return [MicroBatchPlan(index=list(range(i, i + micro_batch_size)), row=list(range(micro_batch_size)),
                               start=[0] * micro_batch_size, length=list(lengths[i:i + micro_batch_size]),
                               rows=micro_batch_size, width=_round_up(width, multiple))
                for i in range(0, n, micro_batch_size)]
    if n == 0:
        return []
    if not pack:
        plans = []
        for group in token_budget_microbatches(lengths, max_tokens):
            used = [lengths[i] for i in group]
            plans.append(MicroBatchPlan(index=list(group), row=list(range(len(group))), start=[0] * len(group),
                                        length=used, rows=len(group), width=_round_up(max(used), multiple)))
        return plans
    # With a budget, one row of up to max_tokens per micro-batch (one THD stream on GPU);
    # without, rows as long as the longest sequence, micro_batch_size of them (today's shape).
    row_len = max_tokens if max_tokens is not None else max(lengths)
    rows = first_fit_decreasing(lengths, row_len)
    per_mb = 1 if max_tokens is not None else micro_batch_size
    plans = []
    for first in range(0, len(rows), per_mb):
        index, row, start, length = [], [], [], []
        fills = []
        for r, members in enumerate(rows[first:first + per_mb]):
            offset = 0
            for i in members:
                index.append(i)
                row.append(r)
                start.append(offset)
                length.append(lengths[i])
                offset += lengths[i]
            fills.append(offset)
        plans.append(MicroBatchPlan(index=index, row=row, start=start, length=length, rows=len(fills),
                                    width=_round_up(max(fills), multiple)))
    return plans


def plan_shared_prompts(lengths: Sequence[int], prompt_lens: Sequence[int], same_prompt: Sequence[bool],
                        micro_batch_size: int, max_tokens: int | None = None,
                        multiple: int = 1) -> list[MicroBatchPlan]:
    """Micro-batches where the samples of one prompt share a single copy of it.

    A GRPO group is n responses to one prompt; as separate rows the prompt is computed n
    times. Here a row holds the prompt once and then the responses one after another: each
    response attends to the prompt and to itself (``MicroBatchPlan.layout``), with positions
    continuing from the prompt's, so every response sees exactly the context it had alone.
    ``same_prompt[i]`` says sequence ``i`` has the same prompt (``prompt_lens[i]`` tokens) as
    sequence ``i - 1``; consecutive runs of such sequences form the groups.

    A row takes a group's responses in order while they fit: at most ``max_tokens`` tokens
    (prompt included) with a budget, else at most ``micro_batch_size`` responses; a group
    that does not fit goes on in a new row with its own copy of the prompt. With a budget,
    rows of similar length are put together as in ``token_budget_microbatches``; without,
    each row is a micro-batch. Deterministic in its inputs.
    """
    n = len(lengths)
    if not (len(prompt_lens) == len(same_prompt) == n):
        raise ValueError(f"{n} lengths, {len(prompt_lens)} prompt lengths, {len(same_prompt)} same_prompt flags")
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
    for i, (length, prompt) in enumerate(zip(lengths, prompt_lens, strict=True)):
        if not 1 <= prompt < length:
            raise ValueError(f"sequence {i}: prompt of {prompt} tokens must leave 1..{length - 1} response tokens")
        if max_tokens is not None and length > max_tokens:
            raise ValueError(f"sequence {i} has {length} tokens > max_tokens {max_tokens}")
    if n and same_prompt[0]:
        raise ValueError("same_prompt[0] must be False: the first sequence starts a group")
    rows: list[list[int]] = []  # sequence indices of each row, the first one's prompt shared
    row_len: list[int] = []  # tokens of each row: the prompt once, then the responses
    for i in range(n):
        response = lengths[i] - prompt_lens[i]
        fits = False
        if same_prompt[i] and rows:
            fits = row_len[-1] + response <= max_tokens if max_tokens is not None else len(rows[-1]) < micro_batch_size
        if fits:
            rows[-1].append(i)
            row_len[-1] += response
        else:
            rows.append([i])
            row_len.append(lengths[i])
    if max_tokens is not None:
        groups = token_budget_microbatches(row_len, max_tokens)
    else:
        groups = [[r] for r in range(len(rows))]
    plans = []
    for group in groups:
        index, row, start, length, shared, prefix_start = [], [], [], [], [], []
        for slot, r in enumerate(group):
            offset = prompt_lens[rows[r][0]]
            for i in rows[r]:
                index.append(i)
                row.append(slot)
                start.append(offset)
                length.append(lengths[i])
                shared.append(prompt_lens[i])
                prefix_start.append(0)
                offset += lengths[i] - prompt_lens[i]
        plans.append(MicroBatchPlan(index=index, row=row, start=start, length=length, rows=len(group),
                                    width=_round_up(max(row_len[r] for r in group), multiple),
                                    shared=shared, prefix_start=prefix_start))
    return plans
