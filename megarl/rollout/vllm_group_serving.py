"""``rollout.granularity: group`` on the engine: groups handed in while a call streams groups out.

``add_groups`` answers from the engine actor's intake thread (a Ray concurrency group of its own)
while ``serve`` holds the main thread, driving vLLM's step loop: requests that arrive join the
running batch at the next step, and each group goes back (a Ray streaming generator) as soon as
its last sample or episode finishes (``megarl.rollout_driver.group_streams`` is the caller's
side). ``serve`` is the one streaming call, for every request kind (``megarl.rollout.requests``):
prompts, continued segments, episodes. A mixin of ``VLLMEngine``, whose state and helpers it uses.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable, Iterator
from typing import Any

from megarl.config.schema import EnvConfig, RewardTermConfig
from megarl.rollout.episodes import EpisodeLimits, Trajectory, suspended_name
from megarl.rollout.requests import PromptRequest, StreamCall
from megarl.rollout.sampling import RolloutSample, SamplingConfig, SegmentRequest
from megarl.rollout.vllm_routes import routes_of_samples

# The Ray concurrency group of ``add_groups``: prompts handed to a running streaming call.
INTAKE_GROUP = "intake"


def _intake_method(fn):
    """Runs ``fn`` in the engine actor's intake group (a plain method without Ray)."""
    try:
        import ray
    except ModuleNotFoundError:
        return fn
    return ray.method(concurrency_group=INTAKE_GROUP)(fn)


class GroupServing:
    """The streaming calls of ``VLLMEngine`` (its ``_intakes`` and ``_intake_lock`` are set there)."""

    @_intake_method
    def add_groups(self, stream: int, prompts: list[tuple[int, Any]]) -> None:
        """More groups, as (index in the batch, the group's requests: a ``PromptRequest``, or a
        ``SegmentRequest`` / ``EpisodeRequest`` or None per member), for streaming call ``stream``
        (running, or about to start: the calls may arrive in either order); an empty list says no
        more will come. Answers at once, while the streaming call holds the engine's main thread."""
        if (intake := self._intake(stream)) is not None:  # None: an interrupted stream; the caller resends them
            intake.put(prompts)

    def serve(self, stream: int, call: StreamCall) -> Iterator[tuple[int, list]]:
        """The one streaming call: serves every group ``add_groups`` sends for ``stream``, each
        group yielded as ``(index, its samples, segments or trajectories)`` as soon as it finishes
        (called as a Ray streaming generator), until the groups are closed and all are done, or
        ``interrupt`` reaches ``call.epoch``. The requests' kind is ``call.kind``."""
        if call.kind == "prompt":
            yield from self._serve_prompts(stream, call.sampling)
        elif call.kind == "segment":
            yield from self._serve_segments(stream, call.sampling, call.epoch)
        else:
            hosting = call.episodes
            yield from self._serve_episodes(stream, call.sampling, hosting.env, hosting.rewards, hosting.limits,
                                            call.epoch, hosting.suspend)

    def _serve_prompts(self, stream: int, sampling: SamplingConfig) -> Iterator[tuple[int, list[RolloutSample]]]:
        """``rollout.granularity: group``: generates every prompt that ``add_groups`` sends for
        ``stream`` and returns each prompt's ``sampling.n`` samples as ``(index, samples)`` as soon as
        the last of them finishes (called as a Ray streaming generator), until the prompts are closed
        and all are done. Prompts that arrive meanwhile join vLLM's running batch at the next step,
        so the caller can hand a prompt to whichever engine frees room first. Sample j of a prompt is
        a request of its own, seeded ``sampling.seed + j`` as vLLM seeds the j-th of ``generate``'s n
        samples: the samples are ``generate``'s, whichever engine draws them."""
        self._check_version(sampling)
        n = sampling.n
        turns = self._turns(sampling, detokenize=False)
        where: dict[str, tuple[int, int]] = {}  # request id -> (prompt, sample)
        request_ids: dict[int, list[str]] = {}  # prompt -> its samples' request ids
        open_groups: dict[int, list] = {}  # prompt index -> its samples so far
        prompts: dict[int, list[int]] = {}

        def admit(i: int, request: PromptRequest) -> None:
            prompt = request.prompt_ids
            prompts[i], open_groups[i], request_ids[i] = list(prompt), [None] * n, []
            for j in range(n):
                self._segment_ids += 1
                request_id = f"megarl-group-{self._segment_ids}"
                where[request_id] = (i, j)
                request_ids[i].append(request_id)
                turns.add(request_id, prompt, sampling.max_tokens, None if sampling.seed is None else sampling.seed + j)

        def finished() -> Iterator[tuple[int, list[RolloutSample]]]:
            for turn in turns.step():
                i, j = where.pop(turn.request_id)
                open_groups[i][j] = RolloutSample(prompts[i], turn.token_ids, turn.logprobs,
                                                  "stop" if turn.stopped else "length")
                if all(open_groups[i]):
                    group = open_groups.pop(i)
                    self._attach_routes(request_ids.pop(i), group)
                    yield i, group

        yield from self._serve(stream, admit, finished, lambda: bool(open_groups), turns.abort)

    def _serve_segments(self, stream: int, sampling: SamplingConfig, epoch: int
                        ) -> Iterator[tuple[int, list[RolloutSample | None]]]:
        """``rollout.granularity: group`` under ``trainer.schedule: opportunistic``: ``_serve_prompts``
        for interruptible samples. ``add_groups`` sends (index, a ``SegmentRequest`` or None per
        sample of the group: None for one finished already); each group comes back as ``(index,
        a segment or None per sample)`` once its last requested sample finishes, and when
        ``interrupt`` reaches ``epoch`` every open group comes back at once, its unfinished samples
        with the tokens they have as "interrupted", and the call ends. A group sent but not yet
        taken in by then never comes back: the caller hands it out again."""
        self._check_version(sampling)
        turns = self._turns(sampling, detokenize=False)
        where: dict[str, tuple[int, int]] = {}  # request id -> (group, sample)
        open_groups: dict[int, list] = {}  # group index -> its samples' segments so far
        asked: dict[int, list[SegmentRequest | None]] = {}

        def admit(i: int, requests: list[SegmentRequest | None]) -> None:
            asked[i], open_groups[i] = list(requests), [None] * len(requests)
            for j, request_id in enumerate(self._add_segments(turns, requests)):
                if request_id is not None:
                    where[request_id] = (i, j)

        def segments(ended: list, reason: Callable[[Any], str]) -> Iterator[tuple[int, list]]:
            for turn in ended:
                i, j = where.pop(turn.request_id)
                open_groups[i][j] = RolloutSample(list(asked[i][j].prompt_ids), turn.token_ids, turn.logprobs,
                                                  reason(turn))
                if all(got is not None or request is None for got, request in zip(open_groups[i], asked[i],
                                                                                     strict=True)):
                    asked.pop(i)
                    yield i, open_groups.pop(i)

        def finished() -> Iterator[tuple[int, list]]:
            yield from segments(turns.step(), lambda turn: "stop" if turn.stopped else "length")

        def interrupted() -> Iterator[tuple[int, list]] | None:
            if self._interrupted_through < epoch:
                return None
            return segments(turns.abort(), lambda turn: "interrupted")

        yield from self._serve(stream, admit, finished, lambda: bool(open_groups), turns.abort, interrupted)

    def _serve_episodes(self, stream: int, sampling: SamplingConfig, env: EnvConfig,
                        rewards: list[RewardTermConfig], limits: EpisodeLimits, epoch: int | None = None,
                        suspend: bool = False) -> Iterator[tuple[int, list[Trajectory | None]]]:
        """``rollout.granularity: group`` with multi-turn episodes: ``_serve_prompts`` for episodes.
        ``add_groups`` sends (index, an ``EpisodeRequest`` or None per episode of the group: None for
        one finished already); each group comes back as ``(index, a trajectory or None per
        episode)`` once its last requested episode finishes, while the episodes of groups sent later
        join the running ones at the next round (``EpisodeRunner.advance``). With ``epoch`` (the
        opportunistic schedule), ``interrupt`` of it ends the call at the next round: every open
        group comes back at once, its finished episodes whole and None for the others, which are
        dropped, or with ``suspend`` kept here as ``suspended_name(stream)`` for ``continue_episodes``
        (in the order they were sent). A group sent but not taken in by then never comes back."""
        from megarl.rollout.episodes import EpisodeRunner, turn_request_id

        self._check_version(sampling)
        make_env, renderer = self._episode_setup(env, rewards)
        runner = EpisodeRunner(self._turns(sampling), renderer, make_env, limits, self._env_loop(),
                               version=self.weight_version)
        open_groups: dict[int, list[int | None]] = {}  # group index -> its episodes' indices in the runner
        kept = False

        def admit(i: int, requests: list) -> None:
            indices = iter(runner.add([r for r in requests if r is not None]))
            open_groups[i] = [None if r is None else next(indices) for r in requests]

        def answered(indices: list[int | None], episodes: list[Trajectory | None]) -> list[Trajectory | None]:
            got = iter(episodes)
            answers = [None if e is None else next(got) for e in indices]
            # an episode's last turn ran every token before its last one
            done = [(e, t) for e, t in zip(indices, answers, strict=True) if t is not None]
            self._attach_routes([turn_request_id(e, turn) for e, t in done for turn in range(len(t.turns))],
                                [t for _, t in done])
            return answers

        def finished() -> Iterator[tuple[int, list[Trajectory | None]]]:
            runner.advance()
            for i in list(open_groups):
                asked = [e for e in open_groups[i] if e is not None]
                if (episodes := runner.take(asked)) is not None:
                    yield i, answered(open_groups.pop(i), episodes)

        def interrupted() -> Iterator[tuple[int, list[Trajectory | None]]] | None:
            nonlocal kept
            if epoch is None or self._interrupted_through < epoch:
                return None
            if not open_groups:  # idle: nothing to cut
                return (group for group in ())  # a generator: Ray's streaming call sends into it
            cut = [(i, answered(indices, runner.take_finished([e for e in indices if e is not None])))
                   for i, indices in open_groups.items()]
            open_groups.clear()
            runner.interrupt(suspend)
            if suspend and runner.suspended:
                self._suspended[suspended_name(stream)], kept = runner, True
            return (group for group in cut)

        def stop() -> None:
            if not kept:
                runner.backend.abort()
                runner.close()

        yield from self._serve(stream, admit, finished, lambda: bool(open_groups), stop, interrupted)

    def _serve(self, stream: int, admit: Callable[[int, Any], None], finished: Callable[[], Iterator[tuple]],
               running: Callable[[], bool], stop: Callable[[], None],
               interrupted: Callable[[], Iterator[tuple] | None] = lambda: None) -> Iterator[tuple]:
        """The loop of the streaming calls: every group that arrives for ``stream`` is ``admit``ted
        before the next step; while one is ``running``, each step's ``finished`` groups are yielded;
        once the groups are closed and none runs, the call ends. When ``interrupted`` gives the
        groups an interruption cut short, those are yielded and the call ends. ``stop`` on the way
        out aborts what still runs (nothing, unless the caller went away mid-stream)."""
        intake = self._intake(stream)
        if self.routing_replay:
            self._taken_routes()  # forget what other calls ran through the model
        closed = False
        started = time.perf_counter()
        try:
            while not closed or running():
                try:  # idle: wait for groups (or the close); else take whatever has arrived
                    arrived = intake.get(timeout=1.0) if not running() else intake.get_nowait()
                except queue.Empty:
                    arrived = None
                if (cut := interrupted()) is not None:  # groups that arrived with it are not taken in
                    yield from cut
                    return
                if arrived is not None:
                    closed |= not arrived
                    for i, payload in arrived:
                        admit(i, payload)
                    continue  # everything that arrived goes in before the next step
                if not running():
                    continue
                for i, group in finished():
                    self._generate_seconds += time.perf_counter() - started
                    yield i, group
                    started = time.perf_counter()
        finally:
            stop()
            self._generate_seconds += time.perf_counter() - started
            with self._intake_lock:
                self._intakes.pop(stream, None)
                self._ended_streams.add(stream)  # groups sent to it later are dropped, not queued

    def _attach_routes(self, requests: list[str], samples: list) -> None:
        """R3: the routes of a finished group's requests, taken from the capture, onto its samples
        (or episodes); nothing without routing replay."""
        if self.routing_replay:
            captured = self._taken_routes(requests)
            for s in samples:
                s.routes = routes_of_samples(captured, s.prompt_ids, s.response_ids, s.response_mask)

    def _intake(self, stream: int):
        """``stream``'s queue of arriving groups; None once the stream has ended."""
        with self._intake_lock:
            if stream in self._ended_streams:
                return None
            return self._intakes.setdefault(stream, queue.SimpleQueue())

