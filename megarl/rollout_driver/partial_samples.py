"""Partial rollouts (``trainer.schedule: opportunistic``): a weight sync does not wait for generation.

When the actor's new weights are ready, the engines are interrupted (one decoding step later each
unfinished sample stops with the tokens it has), the weights land, and every unfinished sample
continues from prompt + its tokens under the new version (``rollout.partial: continue``), or
starts over (``regenerate``). Each response token keeps the version that sampled it, and its
log-prob from those weights, so the off-policy corrections see exactly which tokens are stale.

The unit kind ``Segments`` (an ``InFlight`` batch's ``units``) is a list of ``Slot``s, one per
sample (a group's n samples side by side); each generation call answers some slots. Sample j of
a prompt samples its first segment with the batch's seed + j, as vLLM's n samples of one request
do, and segment s with that + 7919 s.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

from megarl.rollout.sampling import SEGMENT_SEED_STRIDE, RolloutSample, SamplingConfig, SegmentRequest
from megarl.rollout_driver.group_streams import groups_as_they_finish, open_segment_group_streams
from megarl.rollout_driver.inflight import LOST, InFlight, Kept, dispatch
from megarl.utils.shares import contiguous_shares


@dataclass
class Slot:
    """One sample of a batch, as far as it got."""

    prompt_ids: list[int]
    seed: int | None  # of its first segment
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)  # the weight version that sampled each response token
    segments: int = 0  # generation calls it has had
    finish_reason: str | None = None  # "stop" | "length"; None while unfinished

    def request(self, max_tokens: int) -> SegmentRequest:
        seed = None if self.seed is None else self.seed + SEGMENT_SEED_STRIDE * self.segments
        return SegmentRequest(self.prompt_ids + self.response_ids, max_tokens - len(self.response_ids), seed)

    def add(self, segment: RolloutSample, version: int) -> None:
        if segment.finish_reason == "interrupted" and not segment.response_ids:
            return  # cut before its first token: it drew nothing, its next segment keeps the seed
        self.response_ids += segment.response_ids
        self.logprobs += segment.logprobs
        self.versions += [version] * len(segment.response_ids)
        self.segments += 1
        if segment.finish_reason != "interrupted":
            self.finish_reason = segment.finish_reason

    def restart(self) -> None:
        """``rollout.partial: regenerate``: the tokens of older weights are dropped."""
        self.response_ids, self.logprobs, self.versions = [], [], []

    def sample(self) -> RolloutSample:
        return RolloutSample(self.prompt_ids, self.response_ids, self.logprobs, self.finish_reason)



@dataclass
class Segments:
    """The segment unit kind: a batch's samples, a ``Slot`` each, a group's n side by side."""

    slots: list[Slot]
    group_size: int
    regenerate: bool = False  # rollout.partial=regenerate: an unfinished sample starts over each round
    max_num_seqs: int = 1  # rollout.max_num_seqs: how many sequences an engine's stream holds
    kind: Literal["segment"] = "segment"

    @property
    def finished(self) -> bool:
        return all(slot.finish_reason is not None for slot in self.slots)

    def group(self, g: int) -> list[Slot]:
        return self.slots[g * self.group_size:(g + 1) * self.group_size]

    def submit(self, batch: InFlight, fleet: Any, sampling: SamplingConfig, version: int, epoch: int | None) -> None:
        """Every unfinished slot (``regenerate``: from scratch) with version ``version`` (the
        engines refuse another); each live engine a contiguous share, so a group's samples share
        its prompt's cache."""
        assert not batch.in_flight, "a batch's calls must be collected before it is submitted again"
        todo = [i for i, slot in enumerate(self.slots) if slot.finish_reason is None]
        if self.regenerate:
            for i in todo:
                self.slots[i].restart()
        engines = fleet.live_engines() if fleet is not None else {}
        batch.calls, batch.call_slots, batch.call_version = [], [], version
        for e, part in zip(engines, contiguous_shares(todo, len(engines)), strict=True):
            if part:
                requests = [self.slots[i].request(sampling.max_tokens) for i in part]
                batch.calls.append(dispatch(fleet, engines, e, lambda engine, r=requests: engine.generate_segments
                                            .remote(r, sampling, epoch)))
                batch.call_slots.append(part)

    def stream(self, batch: InFlight, engines: list, sampling: SamplingConfig, version: int,
               epoch: int | None) -> None:
        """``submit`` a group at a time: every group with an unfinished sample goes to the
        engines' streams, the next whenever one of an engine's own finishes (``group_streams``)."""
        assert not batch.in_flight, "a batch's calls must be collected before it is submitted again"
        groups = []
        for g in range(len(self.slots) // self.group_size):
            slots = self.group(g)
            if all(slot.finish_reason is not None for slot in slots):
                continue
            if self.regenerate:
                for slot in slots:
                    if slot.finish_reason is None:
                        slot.restart()
            groups.append((g, [None if slot.finish_reason is not None else slot.request(sampling.max_tokens)
                               for slot in slots]))
        batch.call_version = version
        batch.streams = open_segment_group_streams(engines, groups, sampling, epoch, self.max_num_seqs)

    def take_groups(self, batch: InFlight, timeout_s: float) -> Iterator[int]:
        """The streamed groups' segments added to their slots as each group comes back; an
        interruption leaves a group it cut short, or never took in, unfinished for the next round."""
        try:
            for g, segments in groups_as_they_finish(batch.streams, timeout_s):
                for slot, segment in zip(self.group(g), segments, strict=True):
                    if segment is not None:
                        slot.add(segment, batch.call_version)
                if all(slot.finish_reason is not None for slot in self.group(g)):
                    yield g
        finally:
            batch.streams = None

    def collect(self, batch: InFlight, timeout_s: float, fleet: Any = None) -> None:
        """Each segment added to its slot (a failed engine's slots keep what they had, and go on
        elsewhere in the next round)."""
        for i, segment in batch.take_answers(timeout_s, fleet):
            if segment is not LOST:
                self.slots[i].add(segment, batch.call_version)

    def group_samples(self, g: int) -> list[RolloutSample]:
        return [s.sample() for s in self.group(g)]

    def groups(self) -> tuple[list[list[RolloutSample]], None]:
        flat, n = [slot.sample() for slot in self.slots], self.group_size
        return [flat[i:i + n] for i in range(0, len(flat), n)], None

    def token_versions(self) -> list[list[int]]:
        return [list(slot.versions) for slot in self.slots]

    def oldest_version(self, batch: InFlight) -> int:
        return min(v for vs in self.token_versions() for v in vs)

    def annotate(self, rollout: Any) -> None:
        rollout.token_versions = self.token_versions()

    def kept(self) -> Kept:
        """Every sample as far as it got, its seed and segment count: it continues where it stopped."""
        slots = self.slots
        return Kept("samples", list(range(len(slots))), [s.sample() for s in slots], self.token_versions(),
                    extra={"seeds": [s.seed for s in slots], "segments": [s.segments for s in slots]})


def new_batch(index: int, prompt_ids: list[int], prompts: list[list[int]], n: int, seed: int | None,
              regenerate: bool = False, max_num_seqs: int = 1) -> InFlight:
    slots = [Slot(list(prompt), None if seed is None else seed + j) for prompt in prompts for j in range(n)]
    return InFlight(index, list(prompt_ids), n, Segments(slots, n, regenerate, max_num_seqs))
