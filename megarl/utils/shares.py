"""Splitting work over engines in contiguous shares."""

from __future__ import annotations

from typing import TypeVar

T = TypeVar("T")


def contiguous_shares(items: list[T], parts: int, unit: int = 1) -> list[list[T]]:
    """``items`` as ``parts`` contiguous, near-equal shares in order (the last ones may be short or
    empty), never splitting a run of ``unit`` items: a prompt group's samples stay on one engine,
    where they share the prompt's cache."""
    share = -(-len(items) // (unit * parts)) * unit
    return [items[k * share:(k + 1) * share] for k in range(parts)]
