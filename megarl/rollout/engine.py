"""What a rollout backend offers the driver: a core protocol and capability protocols.

Every caller reaches an engine through a Ray actor handle (``engine.generate.remote(...)``).
``RolloutEngine`` is what every backend implements: liveness, generation and scoring, sleep and
wake, and the receiving side of the weight sync (``WeightReceiver``). What only some backends can
do is a capability, each with its own protocol (``CAPABILITY_PROTOCOLS``): interrupting
generation, hosting multi-turn episodes, suspending them across a sync, streaming groups,
recording MoE routes. A backend names its capabilities in ``megarl.rollout.backends``, and
validation refuses, before any process starts, a run whose settings need one it lacks.

``tests/test_rollout_seam.py`` holds this to the code: every method called on an engine handle
(``.remote(...)`` and ``.options(...).remote(...)``) is declared in one of these protocols, and
each backend implements the core and the protocols of the capabilities it claims, with the same
parameters. A new backend is one module (its engine and worker-side receiver) and one registry
entry; it implements ``RolloutEngine`` and ``WeightReceiver`` (the list in ``core_methods()``) and
whichever capability protocols it can.
"""

from __future__ import annotations

from typing import Any, Literal, Protocol, get_args

from megarl.rollout.requests import StreamCall
from megarl.rollout.sampling import RolloutSample, SamplingConfig, SegmentRequest


class WeightReceiver(Protocol):
    """The receiving side of megarl.workers.weight_sync: every backend of an RL run has it."""

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

    def receive_weights(self, plan_id: str, with_checksums: bool = False, delta: str | None = None
                        ) -> list[dict[str, Any]]:
        """Receives this engine's shards in place; per worker, bytes, seconds (and checksums).
        ``delta``: "full" or "delta" under ``trainer.delta_sync`` (``megarl.reshard.delta``)."""


class RolloutEngine(WeightReceiver, Protocol):
    """The core every backend implements."""

    # -- start-up and liveness (liveness answers while generate or a sync blocks) -----------------

    def ready(self) -> bool:
        """True once the engine has loaded (returning at all is the signal)."""

    def health(self) -> Any:
        """The engine's pid, its own processes and those of them that died (``EngineHealth``)."""

    def kill_processes(self) -> int:
        """SIGKILLs the backend's processes (teardown after a failure); how many it killed."""

    def busy_seconds(self) -> float:
        """Seconds spent generating since start (answers while generate blocks)."""

    def shutdown(self) -> None: ...

    # -- generation and scoring ---------------------------------------------------------------

    def generate(self, prompts: list[list[int]], sampling: SamplingConfig) -> list[list[RolloutSample]]:
        """``sampling.n`` samples per prompt: response ids, per-token log-probs after the
        sampling transforms (temperature first), finish reason. Refuses when
        ``sampling.weight_version`` is set and is not the engine's."""

    def prompt_logprobs(self, sequences: list[list[int]]) -> list[list[float]]:
        """log p(token_i | tokens_<i) for i >= 1: the engine's own scoring (weight-sync checks)."""

    def set_weight_version(self, version: int) -> None:
        """Which policy version the weights just received are."""

    # -- memory (colocated placement: megarl.trainer.colocation) ---------------------------------

    def sleep(self) -> None:
        """Releases memory for training (GPU: weights, then KV cache; CPU: pauses scheduling)."""

    def wake_up_weights(self) -> None:
        """Weights back first, so the weight sync lands before the KV cache returns."""

    def wake_up_kv_cache(self) -> None: ...


# -- capabilities ------------------------------------------------------------------------------

Capability = Literal["interrupt", "episodes", "suspend_episodes", "group_streams", "route_capture",
                     "token_meter"]
CAPABILITIES: tuple[str, ...] = get_args(Capability)


class Interruptible(Protocol):
    """trainer.schedule: opportunistic: generation stopped at a weight sync and continued after."""

    def generate_segments(self, requests: list[SegmentRequest], sampling: SamplingConfig,
                          epoch: int) -> list[RolloutSample]:
        """One sample per request, continued from its prompt, stopped early (finish reason
        "interrupted", the tokens so far returned) once ``interrupt`` reaches ``epoch``."""

    def interrupt(self, epoch: int) -> None:
        """Stops the ``generate_segments`` (and interruptible ``generate_episodes``) calls of
        ``epoch`` or earlier at their next step; answers while generation blocks."""


class EpisodeHost(Protocol):
    """env: multi-turn episodes run inside the engine, against the run's environment."""

    def generate_episodes(self, requests: list[Any], sampling: SamplingConfig, env: Any, rewards: list[Any],
                          limits: Any, epoch: int | None = None, keep: str | None = None) -> list[Any]:
        """Multi-turn episodes (``EpisodeRequest`` in, ``Trajectory`` out, in order) against
        ``env`` (an ``EnvConfig``), final answers scored by the ``rewards`` terms; the same
        version fence as ``generate``. With ``epoch``, ``interrupt`` of it stops the unfinished
        episodes (None in their places): dropped, or with ``keep`` suspended under that name."""

    def endpoint_url(self) -> str:
        """The OpenAI-compatible endpoint's base URL on loopback, that ``env.kind: pkg.mod:fn``
        agents talk to ('' before the first agent episode started it; megarl.rollout.endpoint)."""

    def endpoint_turns(self, turns: list[tuple[list[int], Any]], stop_token_ids: list[int],
                       version: int) -> list[Any]:
        """Turns of the endpoint bound for outside callers (prompt ids, ``TurnSpec``), generated
        together: each a ``SampledTurn`` or why the engine refused it; refused whole where the
        engine holds another weight version (megarl.rollout.endpoint.bound)."""


class EpisodeSuspension(Protocol):
    """env with trainer.schedule: opportunistic and rollout.partial: continue: episodes kept
    across a weight sync and continued under the new weights."""

    def continue_episodes(self, keep: str, sampling: SamplingConfig, epoch: int) -> list[Any]:
        """The episodes suspended under ``keep`` go on with the weights held now (in request order;
        None: suspended again by ``interrupt`` of ``epoch``)."""

    def drop_episodes(self, keep: str) -> None:
        """Forgets the episodes suspended under ``keep`` (their environments close)."""


class GroupStreaming(Protocol):
    """rollout.granularity: group: groups of requests (``megarl.rollout.requests``) fed to one
    streaming call, each group back as soon as it finishes (called with
    ``.options(num_returns="streaming")``)."""

    def add_groups(self, stream: int, prompts: list[tuple[int, Any]]) -> None:
        """More groups (index in the batch, a ``PromptRequest``, or a ``SegmentRequest`` /
        ``EpisodeRequest`` or None per member) for ``serve`` call ``stream``, in either order with
        that call; an empty list closes it. Answers while generation blocks."""

    def serve(self, stream: int, call: StreamCall) -> Any:
        """Every group ``add_groups`` sends, of ``call.kind``'s requests, yielded as ``(index, its
        samples, segments or trajectories)`` when it finishes: a prompt's ``sampling.n`` samples; a
        group's segments (None for a member not asked); a group's episodes (None for one not asked,
        or cut). With ``call.epoch``, ``interrupt`` of it ends the call, the open groups coming back
        at once, their samples "interrupted", their unfinished episodes None (dropped, or with
        ``call.episodes.suspend`` kept for ``continue_episodes``)."""


class RouteCapture(Protocol):
    """actor.moe.routing_replay (R3): the engine built with ``routing_replay=True`` returns each
    sample's expert routes (``RolloutSample.routes``); no method of its own."""


class TokenMeter(Protocol):
    """Benchmarks' throughput: tokens sampled, read while generation blocks."""

    def sampled_tokens(self) -> int:
        """Tokens sampled since start by the calls driven a step at a time (answers while they block)."""


CAPABILITY_PROTOCOLS: dict[str, type] = {
    "interrupt": Interruptible, "episodes": EpisodeHost, "suspend_episodes": EpisodeSuspension,
    "group_streams": GroupStreaming, "route_capture": RouteCapture, "token_meter": TokenMeter,
}


def protocol_methods(protocol: type) -> dict[str, Any]:
    """The methods a protocol declares itself and through its bases (its own names, not object's)."""
    found: dict[str, Any] = {}
    for cls in reversed(protocol.__mro__):
        if cls is object or cls is Protocol or not getattr(cls, "_is_protocol", False):
            continue
        found |= {n: f for n, f in vars(cls).items() if callable(f) and not n.startswith("_")}
    return found


def core_methods() -> list[str]:
    """What every backend implements: the list a second backend starts from."""
    return sorted(protocol_methods(RolloutEngine))
