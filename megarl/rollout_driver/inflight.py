"""A batch in flight under the opportunistic schedule, whatever its unit: the bookkeeping every
unit kind shares (the calls or group streams in flight, which units each call answers, the weight
version they sample with, the thread taking streamed groups in), and the waiting on them.

The unit kind is the subclass: ``PartialRollout`` (``megarl.rollout_driver.partial_samples``:
single-turn samples continued segment by segment) and ``PartialEpisodes``
(``megarl.rollout_driver.partial_episodes``: multi-turn episodes, dropped or suspended). It says
what a unit is, how it is asked for and what its answer adds; the schedule
(``megarl.rollout_driver.schedule``) says when, and the buffer (``megarl.rollout_driver.buffer``)
writes either as one entry format.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from megarl.rollout_driver.group_streams import GroupStreams
from megarl.utils.abort import wait_all

# A unit's answer when its call's engine failed (megarl.rollout_driver.fleet): it is asked again.
LOST = object()


@dataclass
class InFlight:
    index: int
    prompt_ids: list[int]  # the dataset's ids of its prompts
    group_size: int
    calls: list = field(default_factory=list, kw_only=True)  # Ray object refs, one per engine call
    call_slots: list[list[int]] = field(default_factory=list, kw_only=True)  # the units each call answers
    call_version: int = field(default=-1, kw_only=True)  # the version the calls in flight sample with
    call_engines: list[int] = field(default_factory=list, kw_only=True)  # the engine each call went to
    # rollout.granularity=group: the groups in flight, and the thread taking them in as they finish
    streams: GroupStreams | None = field(default=None, kw_only=True)
    taking: Future | None = field(default=None, kw_only=True)

    @property
    def finished(self) -> bool:
        raise NotImplementedError

    @property
    def in_flight(self) -> bool:
        return bool(self.calls) or self.streams is not None

    def take_answers(self, timeout_s: float, fleet: Any = None) -> list[tuple[int, Any]]:
        """Waits for the calls (``timeout_s``): (unit, its answer) for every unit asked, and the
        calls are forgotten. With ``fleet`` (an ``EngineFleet``), a call whose engine failed answers
        ``LOST`` for each of its units."""
        if not self.calls:
            return []
        if fleet is None:
            answers = wait_all(self.calls, timeout_s, "generation")
        else:
            answers = fleet.wait_or_lose(self.calls, self.call_engines, timeout_s, "generation")
        taken = [(i, LOST if got is LOST else got[k]) for part, got in zip(self.call_slots, answers, strict=True)
                 for k, i in enumerate(part)]
        self.calls, self.call_slots, self.call_engines = [], [], []
        return taken


def interrupt(engines: list, epoch: int, timeout_s: float) -> None:
    """Every engine (every live one) stops its calls of ``epoch`` or earlier at the next decoding step."""
    wait_all([e.interrupt.remote(epoch) for e in engines], timeout_s, "interrupting generation")
