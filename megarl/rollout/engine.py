"""What a rollout backend offers the driver: the ``RolloutEngine`` interface.

Every caller reaches an engine through a Ray actor handle (``engine.generate.remote(...)``),
so this protocol names each method any caller uses, with its arguments; ``VLLMEngine`` is
the implementation, and ``tests/test_rollout_seam.py`` checks both directions (every
method called on an engine handle is declared here, every method declared here exists on
``VLLMEngine`` with the same parameters). A new backend implements this, its worker-side
receiver of the weight-sync plan, and the destination layout the sync planner builds for.
"""

from __future__ import annotations

from typing import Any, Protocol

from megarl.rollout.sampling import RolloutSample, SamplingConfig, SegmentRequest


class RolloutEngine(Protocol):
    # -- start-up and liveness (liveness answers while generate or a sync blocks) -----------------

    def ready(self) -> bool:
        """True once the engine has loaded (returning at all is the signal)."""

    def health(self) -> Any:
        """The engine's pid, its own processes and those of them that died (``EngineHealth``)."""

    def kill_processes(self) -> int:
        """SIGKILLs the backend's processes (teardown after a failure); how many it killed."""

    def busy_seconds(self) -> float:
        """Seconds spent generating since start (answers while generate blocks)."""

    def sampled_tokens(self) -> int:
        """Tokens sampled since start by the calls driven a step at a time (answers while they block)."""

    # -- generation and scoring ---------------------------------------------------------------

    def generate(self, prompts: list[list[int]], sampling: SamplingConfig) -> list[list[RolloutSample]]:
        """``sampling.n`` samples per prompt: response ids, per-token log-probs after the
        sampling transforms (temperature first), finish reason. Refuses when
        ``sampling.weight_version`` is set and is not the engine's."""

    def generate_segments(self, requests: list[SegmentRequest], sampling: SamplingConfig,
                          epoch: int) -> list[RolloutSample]:
        """One sample per request, continued from its prompt, stopped early (finish reason
        "interrupted", the tokens so far returned) once ``interrupt`` reaches ``epoch``."""

    def interrupt(self, epoch: int) -> None:
        """Stops the ``generate_segments`` (and interruptible ``generate_episodes``) calls of
        ``epoch`` or earlier at their next step; answers while generation blocks."""

    def generate_episodes(self, requests: list[Any], sampling: SamplingConfig, env: Any, rewards: list[Any],
                          limits: Any, epoch: int | None = None, keep: str | None = None) -> list[Any]:
        """Multi-turn episodes (``EpisodeRequest`` in, ``Trajectory`` out, in order) against
        ``env`` (an ``EnvConfig``), final answers scored by the ``rewards`` terms; the same
        version fence as ``generate``. With ``epoch``, ``interrupt`` of it stops the unfinished
        episodes (None in their places): dropped, or with ``keep`` suspended under that name."""

    def continue_episodes(self, keep: str, sampling: SamplingConfig, epoch: int) -> list[Any]:
        """The episodes suspended under ``keep`` go on with the weights held now (in request order;
        None: suspended again by ``interrupt`` of ``epoch``)."""

    def drop_episodes(self, keep: str) -> None:
        """Forgets the episodes suspended under ``keep`` (their environments close)."""

    def add_groups(self, stream: int, prompts: list[tuple[int, list[int]]]) -> None:
        """More prompts (index in the batch, token ids) for ``serve_groups`` call ``stream``, in
        either order with that call; an empty list closes it. Answers while generation blocks."""

    def serve_groups(self, stream: int, sampling: SamplingConfig) -> Any:
        """A streaming call (``rollout.granularity: group``): every prompt ``add_groups`` sends,
        each prompt's ``sampling.n`` samples yielded as ``(index, samples)`` when they finish."""

    def serve_episode_groups(self, stream: int, sampling: SamplingConfig, env: Any, rewards: list[Any],
                             limits: Any, epoch: int | None = None, suspend: bool = False) -> Any:
        """``serve_groups`` for multi-turn episodes: ``add_groups`` sends (index, an
        ``EpisodeRequest`` or None per episode of the group); each group yielded as ``(index, a
        Trajectory or None per episode)``. With ``epoch``, ``interrupt`` of it ends the call, the
        open groups coming back at once, their unfinished episodes dropped or (``suspend``) kept
        for ``continue_episodes``."""

    def prompt_logprobs(self, sequences: list[list[int]]) -> list[list[float]]:
        """log p(token_i | tokens_<i) for i >= 1: the engine's own scoring (weight-sync checks)."""

    # -- weight sync (the receiving side of megarl.workers.weight_sync) -----------------------------

    def param_meta(self) -> list[dict[str, Any]]:
        """Per worker: its TP rank and its parameters' logical shapes (for sync plans)."""

    def join_sync_group(self, host: str, port: int, first_rank: int, world_size: int, backend: str,
                        timeout_s: float = 120.0, same_device: str = "auto") -> list[int]:
        """Every worker joins the sync process group; returns their sync ranks (``same_device``:
        how pairs on one device exchange, ``megarl.reshard.group.SameDevice``)."""

    def leave_sync_group(self) -> None: ...

    def install_plan(self, fragments: dict[int, dict]) -> None:
        """Stores each worker's fragment of a sync plan (keyed by sync rank)."""

    def check_plan(self, plan_id: str) -> list[str | None]:
        """Per worker: None if its installed plan still fits its parameters, else why not."""

    def receive_weights(self, plan_id: str, with_checksums: bool = False) -> list[dict[str, Any]]:
        """Receives this engine's shards in place; per worker, bytes, seconds (and checksums)."""

    def set_weight_version(self, version: int) -> None:
        """Which policy version the weights just received are."""

    # -- memory (colocated placement: megarl.trainer.colocation) ---------------------------------

    def sleep(self) -> None:
        """Releases memory for training (GPU: weights, then KV cache; CPU: pauses scheduling)."""

    def wake_up_weights(self) -> None:
        """Weights back first, so the weight sync lands before the KV cache returns."""

    def wake_up_kv_cache(self) -> None: ...

    def shutdown(self) -> None: ...
