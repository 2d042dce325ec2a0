"""What a rank keeps between calls, and who the rank is.

A WorkerGroup calls plain module-level functions on its ranks; a function returns
and the next call is a new function. Models, optimizers, process groups and engines
must outlive one call, so rank functions keep them in ``state``, a dict that lives
as long as the rank's process (one process per rank, so one ``state`` per rank):

    from megarl.workers.state import current_rank, state

    def build(hf_dir: str) -> None:
        state["model"] = build_model(hf_dir)

    def step(batch) -> float:
        return train(state.require("model"), batch)

``current_rank()`` tells a rank function its role, rank and node-local rank without
asking torch.distributed (which it may not have initialised, or which may hold
another role's group).
"""

from __future__ import annotations

from collections.abc import Iterator, MutableMapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class RankContext:
    """Where this process sits: set by the WorkerGroup when it starts the rank."""

    role: str
    rank: int
    world_size: int
    local_rank: int = 0  # index among this group's ranks on the same node
    local_world_size: int = 1
    node_ip: str = ""


class RankState(MutableMapping[str, Any]):
    """A per-process dict of objects that outlive one call (models, optimizers, groups)."""

    def __init__(self) -> None:
        self._items: dict[str, Any] = {}

    def __getitem__(self, key: str) -> Any:
        return self._items[key]

    def __setitem__(self, key: str, value: Any) -> None:
        self._items[key] = value

    def __delitem__(self, key: str) -> None:
        del self._items[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __repr__(self) -> str:
        return f"RankState({sorted(self._items)})"

    def require(self, key: str) -> Any:
        """Like ``state[key]``, with a message that says which call should have set it."""
        try:
            return self._items[key]
        except KeyError:
            raise KeyError(f"rank state has no {key!r} (it holds {sorted(self._items)}); "
                           f"run the function that creates it on this group first") from None


state = RankState()

_context: RankContext | None = None


def current_rank() -> RankContext:
    """The role and rank of this process; fails outside a WorkerGroup rank."""
    if _context is None:
        raise RuntimeError("not inside a WorkerGroup rank: current_rank() is only set on the group's workers")
    return _context


def set_current_rank(context: RankContext | None) -> None:
    """Called by the WorkerGroup's rank actor; rank functions only read the context."""
    global _context
    _context = context
