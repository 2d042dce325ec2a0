"""The sample unit kind (``Samples``): a prompt's n single-turn samples, generated whole by the
version the batch was submitted against (the exact schedule).

A unit is a prompt (its group): a whole call asks for ``sampling.n`` samples of each prompt of its
share (``generate``), a stream asks a group at a time (``serve_groups``). Sample j of every prompt
is seeded ``seed + j`` on any engine, so the samples do not depend on which engine drew them.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

from megarl.rollout.sampling import RolloutSample, SamplingConfig
from megarl.rollout_driver.group_streams import groups_as_they_finish, open_group_streams
from megarl.rollout_driver.inflight import InFlight, Kept, dispatch
from megarl.utils.shares import contiguous_shares


@dataclass
class Samples:
    prompts: list[list[int]]  # each prompt's token ids
    samples: list[list[RolloutSample] | None]  # each prompt's group once it came back
    max_num_seqs: int = 1  # rollout.max_num_seqs: how many sequences an engine's stream holds
    kind: Literal["sample"] = "sample"

    @property
    def finished(self) -> bool:
        return all(group is not None for group in self.samples)

    def submit(self, batch: InFlight, fleet: Any, sampling: SamplingConfig, version: int, epoch: int | None) -> None:
        """Every prompt's group, the prompts split over the live engines in contiguous shares."""
        engines = fleet.live_engines() if fleet is not None else {}
        todo = [i for i, group in enumerate(self.samples) if group is None]
        batch.calls, batch.call_slots, batch.call_version = [], [], version
        for e, part in zip(engines, contiguous_shares(todo, len(engines)), strict=True):
            if part:
                prompts = [self.prompts[i] for i in part]
                batch.calls.append(dispatch(fleet, engines, e, lambda engine, p=prompts: engine.generate
                                            .remote(p, sampling)))
                batch.call_slots.append(part)

    def stream(self, batch: InFlight, engines: list, sampling: SamplingConfig, version: int,
               epoch: int | None) -> None:
        todo = [i for i, group in enumerate(self.samples) if group is None]
        batch.call_version = version
        batch.streams = open_group_streams(engines, [self.prompts[i] for i in todo], sampling, self.max_num_seqs,
                                           indices=todo)

    def take_groups(self, batch: InFlight, timeout_s: float) -> Iterator[int]:
        try:
            for g, samples in groups_as_they_finish(batch.streams, timeout_s):
                self.samples[g] = samples
                yield g
        finally:
            batch.streams = None

    def collect(self, batch: InFlight, timeout_s: float, fleet: Any = None) -> None:
        for i, group in batch.take_answers(timeout_s, fleet):
            self.samples[i] = group

    def group_samples(self, g: int) -> list[RolloutSample]:
        return list(self.samples[g])

    def groups(self) -> tuple[list[list[RolloutSample]], None]:
        return [list(group) for group in self.samples], None

    def oldest_version(self, batch: InFlight) -> int:
        return batch.call_version

    def annotate(self, rollout: Any) -> None:
        """Every token is the batch's version: nothing to add."""

    def kept(self) -> Kept:
        raise RuntimeError("a batch of whole samples is not checkpointed in flight: the exact schedule's drain "
                           "waits for it")


def new_batch(index: int, prompt_ids: list[int], prompts: list[list[int]], n: int, version: int,
              max_num_seqs: int = 1) -> InFlight:
    return InFlight(index, list(prompt_ids), n, Samples(prompts, [None] * len(prompts), max_num_seqs), version)
