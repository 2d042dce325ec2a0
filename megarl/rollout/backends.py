"""Rollout backends by ``rollout.backend``: the engine class each names and what it can do.

Read before any process starts (validation imports no backend): the capabilities a run's
settings need (``needed_capabilities``) against those its backend claims. Adding a backend is
its engine module (implementing ``megarl.rollout.engine.RolloutEngine`` and the protocols of
the capabilities it claims) and one entry here."""

from __future__ import annotations

from dataclasses import dataclass

from megarl.config.schema import RunConfig
from megarl.rollout.engine import CAPABILITIES, Capability


@dataclass(frozen=True)
class Backend:
    name: str
    engine_class: str  # package.module:Class, imported only where engines start
    capabilities: frozenset[Capability]

    def __post_init__(self) -> None:
        unknown = set(self.capabilities) - set(CAPABILITIES)
        if unknown:
            raise ValueError(f"backend {self.name}: unknown capabilities {sorted(unknown)}")

    def load(self) -> type:
        from megarl.utils.imports import load_object

        return load_object(self.engine_class)


BACKENDS: dict[str, Backend] = {
    "vllm": Backend("vllm", "megarl.rollout.vllm_engine:VLLMEngine", frozenset(CAPABILITIES)),
}


def needed_capabilities(cfg: RunConfig) -> dict[Capability, str]:
    """Each capability the run's settings need, with the setting that needs it."""
    needed: dict[Capability, str] = {}
    opportunistic = cfg.trainer.schedule == "opportunistic"
    if opportunistic:
        needed["interrupt"] = "trainer.schedule=opportunistic"
    if cfg.env is not None:
        needed["episodes"] = f"env.kind={cfg.env.kind!r}"
        if opportunistic and cfg.rollout.partial == "continue":
            needed["suspend_episodes"] = "env with trainer.schedule=opportunistic and rollout.partial=continue"
    if cfg.rollout.granularity == "group":
        needed["group_streams"] = "rollout.granularity=group"
    if cfg.actor.moe.routing_replay:
        needed["route_capture"] = "actor.moe.routing_replay"
    return needed


def backend_errors(cfg: RunConfig) -> list[str]:
    """An unknown ``rollout.backend``, or one that lacks a capability the run's settings need."""
    backend = BACKENDS.get(cfg.rollout.backend)
    if backend is None:
        return [f"rollout.backend={cfg.rollout.backend!r} must be one of {', '.join(sorted(BACKENDS))}"]
    return [f"{setting} needs a rollout backend that can {capability.replace('_', ' ')}; "
            f"rollout.backend={backend.name!r} cannot" for capability, setting in needed_capabilities(cfg).items()
            if capability not in backend.capabilities]
