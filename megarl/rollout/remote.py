"""Rollout engines as Ray actors: one actor per engine, vLLM's TP workers beneath it."""

from __future__ import annotations

import functools
from typing import Any

from megarl.platform import current_platform
from megarl.rollout.sampling import SamplingConfig
from megarl.rollout.vllm_engine import WATCH_GROUP, VLLMEngine


def start_engine(model_path: str, tp: int = 1, dtype: str = "float32", name: str | None = None,
                 num_cpus: float = 1, placement_group: Any = None, bundle_index: int = 0,
                 engine_class: type[VLLMEngine] = VLLMEngine, **engine_kwargs: Any):
    """Starts an ``engine_class`` engine in its own Ray actor; returns the handle at once (it loads in
    the background)."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    options: dict[str, Any] = {"num_cpus": num_cpus, "max_concurrency": 1}
    if gpus := current_platform().gpus_per_rank * tp:
        options["num_gpus"] = gpus  # vLLM's TP workers are processes under this actor: give it their GPUs
    if name:
        options["name"] = name
    if placement_group is not None:
        options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
            placement_group=placement_group, placement_group_bundle_index=bundle_index)
    return _actor_class(engine_class).options(**options).remote(model_path, tp=tp, dtype=dtype, **engine_kwargs)


@functools.cache
def _actor_class(engine_class: type[VLLMEngine]) -> Any:
    import ray

    # One thread runs the engine's calls in order; a second answers liveness checks meanwhile.
    return ray.remote(concurrency_groups={WATCH_GROUP: 1})(engine_class)


def wait_ready(engines: list, timeout_s: float = 600.0) -> None:
    import ray

    ray.get([e.ready.remote() for e in engines], timeout=timeout_s)


def submit_generation(engines: list, prompts: list[list[int]], sampling: SamplingConfig) -> list:
    """Asks the engines for samples of ``prompts``, split into contiguous, near-equal shares in
    engine order; returns one object ref per engine that got prompts, at once (results in order)."""
    share = -(-len(prompts) // len(engines))
    parts = [prompts[i * share:(i + 1) * share] for i in range(len(engines))]
    return [e.generate.remote(p, sampling) for e, p in zip(engines, parts, strict=True) if p]
