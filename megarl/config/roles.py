"""What each role of a run is: one table read by the run, validation and the planner.

A role's name says whether it carries a value head (a one-output ``score`` head instead of the
vocabulary), whether it trains (an optimizer, in every checkpoint) or only scores (an inference
group). Which roles a run has is the algorithm's question (``Algorithm.needs_critic``,
``needs_reference``, ``needs_teacher``) and the recipe's; what each of them is, is answered here."""

from __future__ import annotations

from dataclasses import dataclass


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
