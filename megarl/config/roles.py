"""What each role of a run is: one table read by the run, validation and the planner.

A role's name says whether it carries a value head (a one-output ``score`` head instead of the
vocabulary), whether it trains (an optimizer, in every checkpoint) or only scores (an inference
group). Which roles a run has is the algorithm's question (``Algorithm.needs_critic``,
``needs_reference``, ``needs_teacher``) and the recipe's; what each of them is, is answered here."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megarl.config.schema import RoleConfig


@dataclass(frozen=True)
class RoleKind:
    value_head: bool  # loaded with a one-output score head
    trained: bool  # has an optimizer and is checkpointed; else an inference group that scores


ROLE_KINDS: dict[str, RoleKind] = {
    "actor": RoleKind(value_head=False, trained=True),
    "critic": RoleKind(value_head=True, trained=True),
    "reference": RoleKind(value_head=False, trained=False),
    "reward_model": RoleKind(value_head=True, trained=False),
    "teacher": RoleKind(value_head=False, trained=False),  # on-policy distillation: scores the actor's samples
}
VALUE_HEAD_ROLES: tuple[str, ...] = tuple(n for n, k in ROLE_KINDS.items() if k.value_head)
TRAINED_ROLES: tuple[str, ...] = tuple(n for n, k in ROLE_KINDS.items() if k.trained)


@dataclass(frozen=True)
class RowSplit:
    """How a role splits a step's rows: over its data-parallel ranks, into minibatches (trained
    roles; one pass for the others), of fixed-size micro-batches (1: cut or packed micro-batches
    take any number of rows)."""

    ranks: int
    minibatches: int
    micro_batch: int

    @property
    def multiple(self) -> int:
        """What the row count must be a multiple of."""
        return self.ranks * self.minibatches * self.micro_batch


def row_split(name: str, role: RoleConfig, minibatches: int) -> RowSplit:
    """``name``'s ``RowSplit``, ``minibatches`` being the algorithm's (``algorithm.minibatches``)."""
    trimmed = role.max_tokens_per_microbatch is not None or role.pack_sequences or role.share_prompt
    return RowSplit(role.parallel.data_parallel_size, minibatches if ROLE_KINDS[name].trained else 1,
                    1 if trimmed else role.micro_batch_size)
