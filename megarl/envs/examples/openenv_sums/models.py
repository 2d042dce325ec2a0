"""What crosses the wire: the policy's answer, and the question (then the right answer)."""

from __future__ import annotations

from openenv.core.env_server.types import Action, Observation


class SumsAction(Action):
    answer: str


class SumsObservation(Observation):
    question: str | None = None  # set by reset, None after the step
    correct_answer: str | None = None  # revealed by the step
