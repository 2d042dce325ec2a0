"""What every rollout engine offers the driver (``VLLMEngine`` is the implementation)."""

from __future__ import annotations

from typing import Any, Protocol

from megarl.rollout.sampling import RolloutSample, SamplingConfig


class RolloutEngine(Protocol):
    def generate(self, prompts: list[list[int]], sampling: SamplingConfig) -> list[list[RolloutSample]]:
        """``sampling.n`` samples per prompt: response ids, per-token logprobs, finish reason."""

    def prompt_logprobs(self, sequences: list[list[int]]) -> list[list[float]]:
        """log p(token_i | tokens_<i) for i >= 1: the engine's own scoring (weight-sync checks)."""

    def param_meta(self) -> list[dict[str, Any]]:
        """Per worker: its TP rank and its parameters' logical shapes (for sync plans)."""

    def join_sync_group(self, host: str, port: int, first_rank: int, world_size: int, backend: str,
                        timeout_s: float = 120.0) -> list[int]: ...

    def install_plan(self, fragments: dict[int, dict]) -> None: ...

    def check_plan(self, plan_id: str) -> list[str | None]: ...

    def receive_weights(self, plan_id: str, with_checksums: bool = False) -> list[dict[str, Any]]:
        """Receives this engine's shards in place (the update-weights step of the protocol)."""

    def sleep(self) -> None:
        """Releases memory for training (GPU: weights, then KV cache; CPU: pauses scheduling)."""

    def wake_up_weights(self) -> None: ...

    def wake_up_kv_cache(self) -> None: ...

    def shutdown(self) -> None: ...
