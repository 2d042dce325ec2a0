"""The driver's handle on a Megatron role: its WorkerGroup, config, and model key."""

from __future__ import annotations

from typing import Any

import torch

from megarl.algorithms.base import combine
from megarl.config.schema import AlgorithmConfig, RoleConfig, RunConfig
from megarl.config.supervised import DpoConfig
from megarl.rollout_driver.batch import RolloutBatch
from megarl.workers import checkpoint_fns, megatron_model, offload_fns, rl_fns
from megarl.workers.rank_batch import RankBatch
from megarl.workers.rank_results import TokenStats, UpdateResult, gather_shards


class MegatronRole:
    def __init__(self, name: str, cfg: RoleConfig, group, source: str, timeout_s: float,
                 value_head: bool = False, new_value_head: bool = False):
        self.name, self.cfg, self.group, self.source = name, cfg, group, source
        self.timeout_s = timeout_s
        self.value_head = value_head
        self.new_value_head = new_value_head  # a language model's source: the head starts from its init

    def _run(self, fn, **kwargs) -> list:
        return self.group.run(fn, timeout_s=self.timeout_s, **kwargs)

    def _batching(self) -> dict[str, Any]:
        """How the rank functions cut the batch: fixed micro-batches, a token budget, packing."""
        return {"micro_batch_size": self.cfg.micro_batch_size, "pack_sequences": self.cfg.pack_sequences,
                "max_tokens_per_microbatch": self.cfg.max_tokens_per_microbatch,
                "share_prompt": self.cfg.share_prompt}

    def load(self, timeout_minutes: int = 30) -> None:
        """Builds the role's model at its layout and fills it from its source (HF or checkpoint)."""
        self._run(megatron_model.load, key=self.name, source=self.source, parallel=self.cfg.parallel,
                  dtype=self.cfg.precision.dtype, value_head=self.value_head, timeout_minutes=timeout_minutes,
                  recompute=self.cfg.recompute, new_value_head=self.new_value_head, moe=self.cfg.moe,
                  lora=self.cfg.lora)

    def logprobs(self, batch: RolloutBatch, entropy: bool = False) -> torch.Tensor | TokenStats:
        """The log-probs [B, L-1] of ``batch``'s responses; with ``entropy``, with each prediction's entropy."""
        return gather_shards(self._run(rl_fns.logprobs, key=self.name, batch=batch.to_workers(), entropy=entropy,
                                       **self._batching()))

    def values(self, batch: RolloutBatch) -> torch.Tensor:
        return gather_shards(self._run(rl_fns.values, key=self.name, batch=batch.to_workers(), **self._batching()))

    def scores(self, batch: RolloutBatch) -> torch.Tensor:
        return gather_shards(self._run(rl_fns.scores, key=self.name, batch=batch.to_workers(), **self._batching()))

    def train(self, fn, batch: RankBatch, algo: AlgorithmConfig | DpoConfig | None
              ) -> tuple[dict[str, float], TokenStats | None]:
        """Runs the update ``fn`` (with its settings ``algo``) on every rank: (the update's metrics,
        averaged over its optimizer steps; the per-token outputs it returned, in batch order, or None).
        Each metric combines over data-parallel shards as the rank declared it (``reduce``: summed
        partial sums, or the same on every rank; ``megarl.algorithms.base.Metric``)."""
        shards: list[UpdateResult] = [r for r in self._run(fn, key=self.name, batch=batch, algo=algo,
                                                           optim=self.cfg.optim, **self._batching()) if r is not None]
        reduce = shards[0].reduce
        steps = []
        for per_shard in zip(*(s.steps for s in shards), strict=True):  # one entry per optimizer step
            steps.append({k: combine([s[k] for s in per_shard], reduce[k]) for k in per_shard[0]})
        per_token = [s.per_token for s in shards if s.per_token is not None]
        # logged: the mean over this update's optimizer steps
        metrics = {f"{self.name}/{k}": sum(s[k] for s in steps) / len(steps) for k in steps[0]}
        return metrics, (gather_shards(per_token) if per_token else None)

    def routing_mismatch(self) -> dict[str, float]:
        """R3 (``moe.routing_replay``): the share of the token-layer routings replayed since the last
        call whose own top-k would have chosen other experts; {} for a role that does not replay."""
        if not self.cfg.moe.routing_replay:
            return {}
        counts = self._run(rl_fns.routing_replay_counts, key=self.name)  # (compared, differing) per rank
        compared, differing = sum(c for c, _ in counts), sum(d for _, d in counts)
        return {f"{self.name}/moe/routing_mismatch": differing / compared} if compared else {}

    def save(self, directory: str) -> None:
        self._run(checkpoint_fns.save, key=self.name, out_dir=directory, source=self.source)

    def restore(self, directory: str, with_optimizer: bool) -> None:
        self._run(checkpoint_fns.load, key=self.name, ckpt_dir=directory,
                  optim=self.cfg.optim if with_optimizer else None)

    def offload(self, parts: tuple[str, ...] = offload_fns.PARTS) -> int:
        """Moves ``parts`` (params, grads, optimizer) of every rank off its device; returns bytes freed."""
        return sum(self._run(offload_fns.offload, key=self.name, parts=parts))

    def onload(self) -> int:
        """Brings everything offloaded back onto the ranks' devices; returns bytes restored."""
        return sum(self._run(offload_fns.onload, key=self.name))

    def shutdown(self, graceful: bool = True) -> None:
        self.group.shutdown(graceful=graceful)


def reference_is_actor_base(cfg: RunConfig) -> bool:
    """A LoRA actor whose reference is its own start point scores the reference with its adapters
    off (``BaseOfActor``) instead of a second copy of the weights."""
    return cfg.actor.lora.enabled and cfg.reference is not None and cfg.reference.model.path == cfg.actor.model.path


class BaseOfActor(MegatronRole):
    """The reference role of a LoRA actor: the actor's ranks, adapters off; nothing of its own to
    load, move or stop."""

    def __init__(self, actor: MegatronRole) -> None:
        super().__init__("reference", actor.cfg, actor.group, actor.source, actor.timeout_s)
        self.actor = actor

    def load(self, timeout_minutes: int = 30) -> None:
        pass

    def logprobs(self, batch: RolloutBatch, entropy: bool = False) -> torch.Tensor | TokenStats:
        return gather_shards(self._run(rl_fns.logprobs, key=self.actor.name, batch=batch.to_workers(),
                                       entropy=entropy, base_only=True, **self._batching()))

    def offload(self, parts: tuple[str, ...] = offload_fns.PARTS) -> int:
        return 0  # the actor's own offload moves these weights

    def onload(self) -> int:
        return 0

    def shutdown(self, graceful: bool = True) -> None:
        pass  # the actor's group: the actor stops it
