"""A batch in flight, whatever the schedule and whatever its unit: one class, ``InFlight``.

What every batch shares is here: its prompts, the calls or group streams in flight, which units
each call answers, the weight version they sample with, the thread taking streamed groups in, the
groups scored as they came in. What differs is the unit kind, a strategy object the batch holds
(``units``), which says how a unit is asked for, what its answer adds and how the batch assembles:

- ``Samples`` (``megarl.rollout_driver.whole_samples``): a prompt's n samples, generated whole by
  one version (the exact schedule);
- ``Segments`` (``megarl.rollout_driver.partial_samples``): single-turn samples continued segment
  by segment across weight syncs (the opportunistic schedule);
- ``Episodes`` (``megarl.rollout_driver.partial_episodes``): multi-turn episodes, whole or
  (opportunistic) dropped or suspended at a sync.

The manager picks the unit kind and the transport (whole calls or group streams) from the config
once; the schedule (``megarl.rollout_driver.schedule``) says when a batch is asked again, and the
buffer (``megarl.rollout_driver.buffer``) writes any of them as one entry format.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

from megarl.rollout.episodes import Trajectory
from megarl.rollout.sampling import RolloutSample, SamplingConfig
from megarl.rollout_driver.group_streams import GroupStreams
from megarl.utils.abort import wait_all

if TYPE_CHECKING:
    from megarl.rollout_driver.batch import Rollout

# A unit's answer when its call's engine failed (megarl.rollout_driver.fleet): it is asked again.
LOST = object()

UnitKind = Literal["sample", "segment", "episode"]


class Units(Protocol):
    """A batch's units and what their kind does (the strategy ``InFlight`` holds)."""

    kind: UnitKind

    @property
    def finished(self) -> bool: ...

    def submit(self, batch: InFlight, fleet: Any, sampling: SamplingConfig, version: int,
               epoch: int | None) -> None:
        """Whole calls for every unit still to generate, a contiguous share per live engine; returns at once."""

    def stream(self, batch: InFlight, engines: list, sampling: SamplingConfig, version: int,
               epoch: int | None) -> None:
        """The same a group at a time (``rollout.granularity: group``); returns at once."""

    def collect(self, batch: InFlight, timeout_s: float, fleet: Any) -> None:
        """Waits for the whole calls in flight and adds each unit's answer."""

    def take_groups(self, batch: InFlight, timeout_s: float) -> Iterator[int]:
        """The streamed groups' answers added as each comes back; yields each group then finished."""

    def group_samples(self, g: int) -> list[RolloutSample]:
        """Finished group ``g``'s samples (what the reward terms read)."""

    def groups(self) -> tuple[list[list[RolloutSample]], list[Trajectory] | None]:
        """A finished batch's samples in groups, and its episodes (None: single-turn)."""

    def oldest_version(self, batch: InFlight) -> int:
        """The weight version of the batch's oldest token (the batch's version)."""

    def annotate(self, rollout: Rollout) -> None:
        """What the unit kind adds to an assembled batch (per-token versions, interruptions)."""

    def kept(self) -> Kept:
        """What a checkpoint keeps of an interrupted batch."""


@dataclass
class Kept:
    """What a checkpoint keeps of a batch, any kind, finished or not (``megarl.rollout_driver.buffer``
    writes it as its one entry format): the samples kept (``kept``: their positions in the batch),
    their per-token versions (None: every token is the batch's version), the episodes kept, and
    what the unit kind needs to go on (``extra``: seeds and segment counts, episodes' versions
    and interruptions)."""

    unit: Literal["samples", "episodes"]
    kept: list[int]
    samples: list[RolloutSample]
    token_versions: list[list[int]] | None = None
    episodes: list[Trajectory] | None = None
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class Dispatched:
    """One whole call in flight: the engine (its index in the fleet), its object ref, and ``ask``,
    the same call made of any engine handle (so the fleet can ask another engine)."""

    engine: int
    ref: Any
    ask: Callable[[Any], Any]


@dataclass
class InFlight:
    index: int
    prompt_ids: list[int]  # the dataset's ids of its prompts
    group_size: int
    units: Any  # a ``Units``: the unit kind, holding the units' state
    # the exact schedule: the version that generates the whole batch; None: interruptible, each
    # call samples with ``call_version`` and the batch's version is its oldest token's
    version: int | None = None
    calls: list = field(default_factory=list, kw_only=True)  # fleet Dispatches, one per whole call
    call_slots: list[list[int]] = field(default_factory=list, kw_only=True)  # the units each call answers
    call_version: int = field(default=-1, kw_only=True)  # the version the calls in flight sample with
    # rollout.granularity=group: the groups in flight, and the thread taking them in as they finish
    streams: GroupStreams | None = field(default=None, kw_only=True)
    taking: Future | None = field(default=None, kw_only=True)
    # the exact schedule's batch collected, assembled and scored in the background (``finish_ahead``)
    ready: Future | None = field(default=None, kw_only=True)
    submitted_at: float = field(default_factory=time.monotonic, kw_only=True)
    # groups scored as they came in: each one's reward inputs and reward terms' scores
    scored_groups: dict[int, tuple[list, Any]] = field(default_factory=dict, kw_only=True)
    arrivals: list[float] = field(default_factory=list, kw_only=True)  # seconds from submission, per group

    @property
    def finished(self) -> bool:
        return self.units.finished

    @property
    def in_flight(self) -> bool:
        return bool(self.calls) or self.streams is not None or self.taking is not None

    def take_answers(self, timeout_s: float, fleet: Any = None) -> list[tuple[int, Any]]:
        """Waits for the whole calls (``timeout_s``): (unit, its answer) for every unit asked, and the
        calls are forgotten. With ``fleet`` (an ``EngineFleet``), a call whose engine failed is asked
        again of another engine (the exact schedule: the same seeds give the same answer), or in an
        interruptible batch answers ``LOST`` for each of its units, asked again next round."""
        if not self.calls:
            return []
        if fleet is None:
            answers = wait_all([c.ref for c in self.calls], timeout_s, "generation")
        elif self.version is not None:
            answers = fleet.wait(self.calls, timeout_s, "generation")
        else:
            answers = fleet.wait_or_lose([c.ref for c in self.calls], [c.engine for c in self.calls], timeout_s,
                                         "generation")
        taken = [(i, LOST if got is LOST else got[k]) for part, got in zip(self.call_slots, answers, strict=True)
                 for k, i in enumerate(part)]
        self.calls, self.call_slots = [], []
        return taken


def dispatch(fleet: Any, engines: dict[int, Any], e: int, ask: Callable[[Any], Any]) -> Any:
    """A whole call to engine ``e`` as the fleet's ``Dispatch`` (without a fleet: a plain record)."""
    if fleet is not None:
        return fleet.dispatch(e, ask)
    return Dispatched(e, ask(engines[e]), ask)


def interrupt(engines: list, epoch: int, timeout_s: float) -> None:
    """Every engine (every live one) stops its calls of ``epoch`` or earlier at the next decoding step."""
    wait_all([e.interrupt.remote(epoch) for e in engines], timeout_s, "interrupting generation")
