"""Batches of prompts per RL step, shuffled per epoch from a seed, resumable exactly.

The order of epoch ``e`` is a permutation drawn from ``random.Random(f"{seed}:{epoch}")``:
string seeds are hashed with SHA-512 by Python itself (not ``hash()``), so the order is
the same in every process and every run. The position (epoch, index within the
epoch's order) is all the state there is, so a checkpoint stores a few ints and a
resumed run serves exactly the batches the original would have served next.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from typing import Generic, TypeVar

T = TypeVar("T")


class PromptDataset(Generic[T]):
    """Serves ``batch_size`` items per :meth:`next_batch`, forever, epoch after epoch.

    ``drop_last=True`` (the default) gives every step a full batch: the last
    ``len(items) % batch_size`` items of each epoch's order are skipped (a different
    few each epoch). With ``drop_last=False`` the last batch of an epoch may be short.
    """

    def __init__(self, items: Sequence[T], batch_size: int, seed: int = 0, shuffle: bool = True,
                 drop_last: bool = True) -> None:
        if not items:
            raise ValueError("PromptDataset: no prompts")
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
            raise ValueError(f"PromptDataset: batch_size must be a positive integer, got {batch_size!r}")
        if drop_last and batch_size > len(items):
            raise ValueError(f"PromptDataset: batch_size {batch_size} > {len(items)} prompts; "
                             "lower batch_size or set drop_last=False")
        if not isinstance(seed, int):
            raise ValueError(f"PromptDataset: seed must be an integer, got {seed!r}")
        self.items = items
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.epoch = 0
        self.position = 0  # index into the current epoch's order of the next item to serve
        self.step = 0  # batches served so far (for logging; not needed to resume)
        self._order_epoch = -1
        self._order: list[int] = []

    def __len__(self) -> int:
        """Batches per epoch."""
        full, rest = divmod(len(self.items), self.batch_size)
        return full + (1 if rest and not self.drop_last else 0)

    def order(self, epoch: int) -> list[int]:
        """Item indices in the order epoch ``epoch`` serves them."""
        if epoch != self._order_epoch:
            order = list(range(len(self.items)))
            if self.shuffle:
                random.Random(f"{self.seed}:{epoch}").shuffle(order)
            self._order, self._order_epoch = order, epoch
        return self._order

    def next_batch(self) -> list[T]:
        return [self.items[i] for i in self.next_ids()]

    def next_ids(self) -> list[int]:
        """The next batch as indices into ``items``: a prompt's id, for accounting across resumes."""
        remaining = len(self.items) - self.position
        if remaining == 0 or (self.drop_last and remaining < self.batch_size):
            self.epoch += 1
            self.position = 0
        order = self.order(self.epoch)
        indices = order[self.position:self.position + self.batch_size]
        self.position += len(indices)
        self.step += 1
        return list(indices)

    def __iter__(self) -> Iterator[list[T]]:
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict[str, int]:
        # num_items and seed are stored to catch a resume against different data.
        return {"epoch": self.epoch, "position": self.position, "step": self.step, "seed": self.seed,
                "num_items": len(self.items), "batch_size": self.batch_size}

    def load_state_dict(self, state: dict[str, int]) -> None:
        for key in ("epoch", "position", "step", "seed", "num_items", "batch_size"):
            if key not in state:
                raise KeyError(f"PromptDataset state: missing {key!r} (have {sorted(state)})")
            if not isinstance(state[key], int) or isinstance(state[key], bool):
                raise ValueError(f"PromptDataset state: {key!r} must be an integer, got {state[key]!r}")
        for key, current in (("seed", self.seed), ("num_items", len(self.items)), ("batch_size", self.batch_size)):
            if state[key] != current:
                raise ValueError(f"PromptDataset state: {key} is {state[key]} in the checkpoint but {current} now; "
                                 "resuming would serve different batches")
        if not 0 <= state["position"] <= len(self.items) or state["epoch"] < 0 or state["step"] < 0:
            raise ValueError(f"PromptDataset state: position {state['position']} / epoch {state['epoch']} / "
                             f"step {state['step']} out of range for {len(self.items)} prompts")
        self.epoch, self.position, self.step = state["epoch"], state["position"], state["step"]
