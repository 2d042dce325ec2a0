"""Rollout engines as Ray actors: one actor per engine, vLLM's TP workers beneath it."""

from __future__ import annotations

import functools
from dataclasses import replace
from typing import Any

from megarl.config.schema import RunConfig
from megarl.data.prompts import PromptItem
from megarl.envs.base import EpisodeItem, Message
from megarl.platform import current_platform
from megarl.rollout.episodes import EpisodeLimits, EpisodeRequest
from megarl.rollout.sampling import SamplingConfig
from megarl.rollout.vllm_engine import WATCH_GROUP, VLLMEngine
from megarl.rollout.vllm_group_serving import INTAKE_GROUP
from megarl.utils.cores import usable_cores
from megarl.utils.shares import contiguous_shares


def start_engine(model_path: str, tp: int = 1, dtype: str = "float32", name: str | None = None,
                 num_cpus: float = 1, placement_group: Any = None, bundle_index: int = 0,
                 engine_class: type[VLLMEngine] = VLLMEngine, num_gpus: float | None = None, **engine_kwargs: Any):
    """Starts an ``engine_class`` engine in its own Ray actor; returns the handle at once (it loads in
    the background). ``num_gpus``: the engine's share of its bundle (a colocated engine shares one
    GPU with the roles beside it); by default a whole GPU per TP worker."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    options: dict[str, Any] = {"num_cpus": num_cpus, "max_concurrency": 1}
    import ray

    # by default a whole GPU per TP worker where the cluster has GPUs (the driver may have none)
    gpus = (tp if ray.cluster_resources().get("GPU", 0) > 0 else 0) if num_gpus is None else num_gpus
    if gpus:
        options["num_gpus"] = gpus  # vLLM's TP workers are processes under this actor: give it their GPUs
    threads = engine_kwargs.get("cpu_threads") or usable_cores()
    if env := current_platform().vllm_actor_env(tp, threads):
        options["runtime_env"] = {"env_vars": env}
    if name:
        options["name"] = name
    if placement_group is not None:
        options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
            placement_group=placement_group, placement_group_bundle_index=bundle_index)
    return _actor_class(engine_class).options(**options).remote(model_path, tp=tp, dtype=dtype, **engine_kwargs)


@functools.cache
def _actor_class(engine_class: type[VLLMEngine]) -> Any:
    import ray

    # One thread runs the engine's calls in order; a second answers liveness checks meanwhile, a
    # third takes prompts for a running serve_groups call.
    return ray.remote(concurrency_groups={WATCH_GROUP: 1, INTAKE_GROUP: 1})(engine_class)


def wait_ready(engines: list, timeout_s: float = 600.0) -> None:
    import ray

    ray.get([e.ready.remote() for e in engines], timeout=timeout_s)


def submit_generation(engines: list, prompts: list[list[int]], sampling: SamplingConfig) -> list:
    """Asks the engines for samples of ``prompts``, split into contiguous, near-equal shares in
    engine order; returns one object ref per engine that got prompts, at once (results in order)."""
    parts = contiguous_shares(prompts, len(engines))
    return [e.generate.remote(p, sampling) for e, p in zip(engines, parts, strict=True) if p]


def submit_episodes(engines: list, items: list[EpisodeItem], sampling: SamplingConfig, cfg: RunConfig) -> list:
    """Asks the engines for ``sampling.n`` episodes of each item with ``cfg.env`` (a group's
    episodes on one engine, where they share the prompt's cache), items split as
    ``submit_generation`` splits prompts; one object ref per engine that got items."""
    requests = episode_requests(items, sampling, cfg)
    parts = contiguous_shares(requests, len(engines), unit=sampling.n)
    return [submit_episode_requests(e, p, sampling, cfg) for e, p in zip(engines, parts, strict=True) if p]


def episode_requests(items: list[EpisodeItem], sampling: SamplingConfig, cfg: RunConfig) -> list[EpisodeRequest]:
    """``sampling.n`` episodes of each item, its context after ``cfg.env.prelude``; episode j of
    item i samples with seed ``sampling.seed`` + 1000 * (i * n + j) + turn."""
    n = sampling.n
    prelude = tuple(Message(m["role"], m["content"], m.get("name")) for m in cfg.env.prelude)
    items = [replace(item, context=prelude + item.context) for item in items]
    return [EpisodeRequest(item, None if sampling.seed is None else sampling.seed + 1000 * (i * n + j))
            for i, item in enumerate(items) for j in range(n)]


def submit_episode_requests(engine: Any, requests: list[EpisodeRequest], sampling: SamplingConfig, cfg: RunConfig,
                            epoch: int | None = None, keep: str | None = None) -> Any:
    """One engine's call for ``requests`` (with ``epoch``: interruptible, the opportunistic schedule;
    with ``keep``, the interrupted episodes are suspended on the engine under that name)."""
    return engine.generate_episodes.remote(requests, replace(sampling, n=1), cfg.env, cfg.rewards,
                                           episode_limits(cfg), epoch, keep)


def episode_limits(cfg: RunConfig, max_turn_tokens: int | None = None) -> EpisodeLimits:
    env = cfg.env
    return EpisodeLimits(max_turns=env.max_turns, max_episode_tokens=env.max_episode_tokens,
                         max_turn_tokens=max_turn_tokens or cfg.rollout.max_tokens,
                         max_model_len=cfg.rollout.max_model_len, max_concurrent=env.max_concurrent_episodes,
                         overlap=env.overlap, step_timeout_s=env.step_timeout_s,
                         session_wall_s=cfg.rollout.endpoint.session_wall_s)


def episode_item(item: PromptItem) -> EpisodeItem:
    """A dataset item as an episode's start: its text prompt, or its chat messages as an optional
    system message and one user message (validation refuses other shapes for env runs)."""
    if item.prompt is not None:
        return EpisodeItem(item.prompt, item.metadata)
    messages = list(item.messages or [])
    system = messages.pop(0)["content"] if messages and messages[0]["role"] == "system" else None
    if len(messages) != 1 or messages[0]["role"] != "user":
        raise ValueError("an episode starts from one user message (and an optional system message)")
    return EpisodeItem(messages[0]["content"], item.metadata, system_prompt=system)
