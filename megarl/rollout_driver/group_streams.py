"""``rollout.granularity: group``: a batch's prompts handed to the engines a group at a time.

Each engine first gets as many groups as its running batch holds (``max_num_seqs`` sequences,
``n`` to a group); after that a waiting group goes to the engine whose group just finished, the
first to have room, so an engine that draws short answers takes more of the batch and none waits
on another's long tail. Every group comes back on its own as soon as its last sample finishes
(the engine's one streaming call, ``serve``, a Ray streaming generator, told the requests' kind
by a ``StreamCall``). The samples do not depend on which engine draws them: sample j of every
prompt is seeded ``seed + j`` on any engine, as in a whole batch's ``generate``. Multi-turn
episodes stream the same way, a group's episodes together, and so do the interruptible samples of
the opportunistic schedule: an interruption ends the streams early.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any

from megarl.config.schema import RunConfig
from megarl.rollout.episodes import EpisodeRequest
from megarl.rollout.requests import EpisodeHosting, PromptRequest, StreamCall
from megarl.rollout.sampling import RolloutSample, SamplingConfig, SegmentRequest
from megarl.utils.abort import RUN_ABORT

_stream_ids = itertools.count(1)  # unique in the process that submits: one per (batch, engine) call


@dataclass
class GroupStreams:
    """One batch in flight, a group at a time: each engine's stream, and the groups not yet handed out."""

    engines: list  # Ray handles of the engines that got groups
    streams: list[int]  # each engine's serve call id
    calls: list  # each engine's object ref generator
    # (index in the batch, what the engine's call takes: prompt ids, episode or segment requests)
    waiting: deque = field(default_factory=deque)
    closed: bool = False
    came_from: dict[int, int] = field(default_factory=dict)  # group index -> position of the engine that sent it


def open_group_streams(engines: list, prompts: list[list[int]], sampling: SamplingConfig,
                       max_num_seqs: int, indices: list[int] | None = None) -> GroupStreams:
    """Starts one ``serve`` call of prompts per engine with the groups that fill its running batch
    (``indices``: each prompt's index in the batch, by default its position); returns at once."""
    groups = [(i, PromptRequest(list(p))) for i, p in
              zip(range(len(prompts)) if indices is None else indices, prompts, strict=True)]
    return _open(engines, groups, max(1, max_num_seqs // max(1, sampling.n)), StreamCall("prompt", sampling))


def open_segment_group_streams(engines: list, groups: list[tuple[int, list[SegmentRequest | None]]],
                               sampling: SamplingConfig, epoch: int, max_num_seqs: int) -> GroupStreams:
    """The same for interruptible samples (``trainer.schedule: opportunistic``): each group as (its
    index in the batch, a ``SegmentRequest`` or None per sample, None for one finished already);
    ``interrupt`` of ``epoch`` ends every stream, the groups it cut short coming back with what they
    have."""
    group_size = len(groups[0][1]) if groups else 1
    return _open(engines, groups, max(1, max_num_seqs // group_size), StreamCall("segment", sampling, epoch))


def open_episode_group_streams(engines: list, groups: list[tuple[int, list[EpisodeRequest | None]]],
                               sampling: SamplingConfig, cfg: RunConfig, epoch: int | None = None,
                               suspend: bool = False) -> GroupStreams:
    """The same for multi-turn episodes (``cfg.env``): each group as (its index in the batch, an
    ``EpisodeRequest`` or None per episode, None for one finished already); each engine first gets
    the groups its ``env.max_concurrent_episodes`` hold. With ``epoch`` (the opportunistic
    schedule), ``interrupt`` of it ends every stream, the groups it cut short coming back with
    their finished episodes and None for the others, dropped or (``suspend``) kept on that
    engine."""
    from megarl.rollout.remote import episode_limits

    n = max(1, sampling.n)
    call = StreamCall("episode", replace(sampling, n=1), epoch,
                      EpisodeHosting(cfg.env, cfg.rewards, episode_limits(cfg), suspend))
    return _open(engines, groups, max(1, cfg.env.max_concurrent_episodes // n), call)


def _open(engines: list, groups: list[tuple[int, Any]], per_engine: int, call: StreamCall) -> GroupStreams:
    waiting = deque(groups)
    out = GroupStreams([], [], [], waiting)
    for engine in engines:
        if not waiting:
            break
        first = [waiting.popleft() for _ in range(min(per_engine, len(waiting)))]
        stream = next(_stream_ids)
        engine.add_groups.remote(stream, first)
        out.engines.append(engine)
        out.streams.append(stream)
        out.calls.append(engine.serve.options(num_returns="streaming").remote(stream, call))
    _close_if_done(out)
    return out


def groups_as_they_finish(batch: GroupStreams, timeout_s: float) -> Iterator[tuple[int, list[RolloutSample]]]:
    """Every group of the batch as ``(index in the batch, samples)`` (of episodes: trajectories), in
    the order they finish, handing each waiting group to the engine that just returned one. Raises an engine's error,
    ``Aborted`` when the run is aborted, ``TimeoutError`` after ``timeout_s``."""
    import ray

    deadline = time.monotonic() + timeout_s
    live = dict(enumerate(batch.calls))  # engine position -> its generator
    while live:
        RUN_ABORT.check()
        ready, _ = ray.wait(list(live.values()), num_returns=1,
                            timeout=min(1.0, max(0.0, deadline - time.monotonic())))
        for call in ready:
            e = next(k for k, v in live.items() if v is call)
            try:
                index, samples = ray.get(next(call))
            except StopIteration:
                del live[e]
                continue
            if batch.waiting:  # the engine that finished a group has room for the next
                batch.engines[e].add_groups.remote(batch.streams[e], [batch.waiting.popleft()])
                _close_if_done(batch)
            batch.came_from[index] = e
            yield index, samples
        if live and time.monotonic() >= deadline:
            raise TimeoutError(f"generation did not finish within {timeout_s:.0f} s")


def _close_if_done(batch: GroupStreams) -> None:
    """Once every group is handed out, each stream ends after its last one."""
    if not batch.waiting and not batch.closed:
        for engine, stream in zip(batch.engines, batch.streams, strict=True):
            engine.add_groups.remote(stream, [])
        batch.closed = True
