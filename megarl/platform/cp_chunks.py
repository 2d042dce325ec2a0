"""Where a context-parallel rank's tokens sit in the sequence: megatron-core's load-balanced split.

Each of ``cp`` ranks holds 2 of the sequence's ``2 * cp`` equal chunks, chunk ``r`` and chunk
``2 * cp - 1 - r`` (under a causal mask an early chunk sees few keys and a late one many, so each
rank gets one of each). Apart from the attention (``megarl.platform.cp_attention``) because the
driver splits and reassembles sequences with these too, and must not import megatron-core for it.
"""

from __future__ import annotations

import torch


def global_positions(local_len: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """The sequence positions ``[local_len]`` of rank ``rank``'s tokens: chunks ``rank`` and
    ``2 * cp - 1 - rank`` of ``2 * cp``, each ``local_len / 2`` long."""
    if local_len % 2:
        raise ValueError(f"a context-parallel rank's share of the sequence must be even, got {local_len}")
    chunk = local_len // 2
    first = torch.arange(chunk, device=device) + rank * chunk
    return torch.cat([first, torch.arange(chunk, device=device) + (2 * cp - 1 - rank) * chunk])


def to_sequence_order(parts: list[torch.Tensor], dim: int) -> torch.Tensor:
    """Every rank's share, in rank order, -> the whole sequence along ``dim`` in position order."""
    cp = len(parts)
    halves = [p.chunk(2, dim=dim) for p in parts]
    return torch.cat([halves[r][0] for r in range(cp)] + [halves[r][1] for r in reversed(range(cp))], dim=dim)


def own_share(whole: torch.Tensor, cp: int, rank: int, dim: int) -> torch.Tensor:
    """The inverse of ``to_sequence_order`` for one rank: its two chunks of ``whole`` along ``dim``."""
    chunks = whole.chunk(2 * cp, dim=dim)
    return torch.cat([chunks[rank], chunks[2 * cp - 1 - rank]], dim=dim)
