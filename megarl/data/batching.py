"""Micro-batching by token budget, sequence packing, and right padding.

All three are pure functions of their inputs (no randomness, ties broken by index),
so every data-parallel rank that sees the same lengths builds the same batches.
"""

from __future__ import annotations

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


def pack_sequences(seqs: Sequence[Sequence[int]], max_len: int) -> PackedRows:
    """First-fit decreasing: longest sequence first (ties by index), each into the first
    row with room, a new row when none has. Rows hold at most ``max_len`` tokens; a
    sequence longer than ``max_len`` is an error (splitting it would change its meaning),
    and so is an empty one (a zero-length segment breaks varlen kernels).
    """
    lengths = [len(seq) for seq in seqs]
    _check_lengths(lengths, max_len, "max_len", "sequence")
    empty = [i for i, length in enumerate(lengths) if length == 0]
    if empty:
        raise ValueError(f"sequence {empty[0]} is empty; packing needs at least one token per sequence")
    rows: list[list[int]] = []
    cu_seqlens: list[list[int]] = []
    seq_index: list[list[int]] = []
    for index in sorted(range(len(seqs)), key=lambda i: (-lengths[i], i)):
        length = lengths[index]
        r = next((r for r, cu in enumerate(cu_seqlens) if cu[-1] + length <= max_len), None)
        if r is None:
            r = len(rows)
            rows.append([])
            cu_seqlens.append([0])
            seq_index.append([])
        rows[r].extend(seqs[index])
        cu_seqlens[r].append(cu_seqlens[r][-1] + length)
        seq_index[r].append(index)
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
