"""The rollout service: the rollout manager and its queue in a Ray actor of their own.

The driver asks the service for step s's batch (``take``) and, around a weight sync or a
checkpoint, for the queue's hand-overs (``drain``, ``resume``, ``save``). Everything else happens
in the service while the trainer works: it draws prompts from the dataset cursor, has the engines
generate up to ``trainer.max_staleness`` batches ahead, and as soon as the engines return a batch
a background thread assembles it and scores it with the reward terms, so that a batch is ready
to train on when its step comes (with a reward model, whose score is the trainer's, or a term that
needs a main thread, the driver scores the batch). The
fence (no batch outside the staleness bound) and the order of batches stay the queue's
(``megarl.rollout_driver.batch_queue``): the service changes where the work runs, not what it computes,
and a run repeats its metrics bit for bit.

Every call on the service has a timeout, and an error in it reaches the driver as the error the
service saw (an engine's, a timeout, a stale batch), not wrapped in Ray's.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

import torch

from megarl.config.schema import RunConfig
from megarl.data.dataset import PromptDataset
from megarl.data.prompts import PromptItem
from megarl.rewards.combined import RunReward
from megarl.rollout_driver.batch import Rollout
from megarl.rollout_driver.batch_queue import RolloutQueue
from megarl.rollout_driver.inflight import InFlight
from megarl.rollout_driver.manager import RolloutManager
from megarl.rollout_driver.scoring import Scores, Scoring
from megarl.utils.abort import wait_all

# The concurrency group of the calls about engine faults: they answer while a take waits on the
# failed engine's calls (the service's other calls run one at a time).
FLEET_GROUP = "fleet"


def _fleet_method(fn):
    try:
        import ray
    except ModuleNotFoundError:  # a machine without Ray runs no service anyway
        return fn
    return ray.method(concurrency_group=FLEET_GROUP)(fn)


class RolloutService:
    """The actor's side: a rollout manager that finishes batches ahead, and its queue."""

    def __init__(self, cfg: RunConfig, engines: list, tokenizer: Any, dataset: PromptDataset[PromptItem]):
        # the reward terms are built here, from the config, as the engines build an environment's
        self.manager = RolloutManager(cfg, engines, tokenizer, dataset, RunReward(cfg.rewards))
        self.manager.finish_ahead()
        self.queue = RolloutQueue(self.manager, cfg.trainer.max_staleness, last_step=cfg.trainer.steps,
                                  schedule=cfg.trainer.schedule)

    def pid(self) -> int:
        return os.getpid()

    def take(self, step: int) -> Rollout:
        return self.queue.take(step)

    def drain(self) -> None:
        self.queue.drain()

    def resume(self, version: int) -> None:
        self.queue.resume(version)

    def state_dict(self) -> dict[str, Any]:
        """The prompt stream's position and the queue's, as a checkpoint records them."""
        return {"data": self.manager.state_dict(), "queue": self.queue.state_dict()}

    def save(self, folder: str) -> None:
        self.queue.save(Path(folder))

    def load(self, folder: str, state: dict[str, Any]) -> None:
        self.manager.load_state_dict(state["data"])
        self.queue.load(Path(folder), state["queue"])

    # -- engine faults (megarl.rollout_driver.fleet) ---------------------------------------------

    @_fleet_method
    def engine_failed(self, index: int) -> None:
        """The driver's watchdog saw engine ``index`` fail: answered while ``take`` waits on it."""
        self.manager.fleet.mark_failed(index)

    @_fleet_method
    def replace_engine(self, index: int, engine: Any) -> None:
        """Engine ``index``'s replacement, holding the current weights (between a drain and a resume,
        or while a take waits on the failed engine's calls: no other engine could take them)."""
        self._forget_suspended(index, dropped=False)
        self.manager.fleet.replace(index, engine)

    def drop_engine(self, index: int) -> None:
        self._forget_suspended(index, dropped=True)
        self.manager.fleet.drop(index)

    def _forget_suspended(self, index: int, dropped: bool) -> None:
        """The episodes suspended on a failed engine start over from their reset (a replacement holds none)."""
        for queued in list(self.queue.batches.values()):  # a take may change them meanwhile
            if isinstance(queued, InFlight) and queued.units.kind == "episode":
                queued.units.forget_engine(index, dropped)

    @_fleet_method
    def fleet_counters(self) -> dict[str, int]:
        return self.manager.fleet.counters()


class RolloutClient:
    """The driver's handle on the service: the queue's calls, each with a timeout, and the scoring
    that needs the trainer (a reward model's score, per-turn credit), done here."""

    def __init__(self, actor: Any, cfg: RunConfig, reward: RunReward):
        self.actor, self.cfg, self.reward = actor, cfg, reward
        self.scoring = Scoring(cfg, reward)  # what needs the trainer's reward model, scored here
        tr = cfg.trainer
        # a take waits for generation (the service's own wait is step_timeout_s); the rest are quick
        self.generation_timeout_s = tr.step_timeout_s + tr.collective_timeout_s
        self.call_timeout_s = tr.collective_timeout_s

    @property
    def needs_reward_model(self) -> bool:
        return self.reward.needs_model

    def pid(self) -> int:
        """The service's process (once it is up: the first call waits for its start)."""
        return self._call("pid", timeout_s=self.generation_timeout_s)

    def take(self, step: int) -> Rollout:
        """Step ``step``'s batch, within the staleness bound, scored unless a reward model's score is needed."""
        return self._call("take", step, timeout_s=self.generation_timeout_s)

    def drain(self) -> None:
        """No generation in flight when this returns (waited for, or interrupted: ``trainer.schedule``)."""
        self._call("drain", timeout_s=self.generation_timeout_s)

    def resume(self, version: int) -> None:
        self._call("resume", version, timeout_s=self.call_timeout_s)

    def state_dict(self) -> dict[str, Any]:
        return self._call("state_dict", timeout_s=self.call_timeout_s)

    def save(self, folder: Path) -> None:
        self._call("save", str(folder), timeout_s=self.call_timeout_s)

    def load(self, folder: Path, state: dict[str, Any]) -> None:
        self._call("load", str(folder), state, timeout_s=self.call_timeout_s)

    def score(self, rollout: Rollout, model_scores: torch.Tensor | None = None) -> Scores:
        return self.scoring.batch(rollout, model_scores)

    def turn_rewards(self, rollout: Rollout, scores: torch.Tensor) -> torch.Tensor | None:
        return self.scoring.turn_rewards(rollout, scores)

    def engine_failed(self, index: int) -> None:
        """Tells the service engine ``index`` failed (no wait: the watchdog's thread calls it)."""
        self._tell("engine_failed", index)

    def replace_engine(self, index: int, engine: Any) -> None:
        self._call("replace_engine", index, engine, timeout_s=self.call_timeout_s)

    def drop_engine(self, index: int) -> None:
        self._call("drop_engine", index, timeout_s=self.call_timeout_s)

    def fleet_counters(self) -> dict[str, int]:
        return self._call("fleet_counters", timeout_s=self.call_timeout_s)

    def stop(self) -> None:
        import ray

        with contextlib.suppress(Exception):
            ray.kill(self.actor)

    def _tell(self, method: str, *args: Any) -> None:
        """A call on the service that nobody waits for."""
        getattr(self.actor, method).remote(*args)

    def _call(self, method: str, *args: Any, timeout_s: float) -> Any:
        from ray.exceptions import RayTaskError

        try:
            call = getattr(self.actor, method).remote(*args)
            return wait_all([call], timeout_s, f"the rollout service's {method}")[0]
        except RayTaskError as error:  # the service's own error, as if it had been raised here
            if isinstance(error.cause, Exception):
                raise error.cause from None
            raise


def start_rollout_service(cfg: RunConfig, engines: list, tokenizer: Any, dataset: PromptDataset[PromptItem],
                          reward: RunReward) -> RolloutClient:
    """Starts the service on the driver's node (it writes into the run's checkpoints) and returns the
    driver's client at once. It takes no CPU of the placement: it mostly waits on the engines."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    actor = ray.remote(concurrency_groups={FLEET_GROUP: 1})(RolloutService).options(
        num_cpus=0, max_concurrency=1, scheduling_strategy=here).remote(cfg, engines, tokenizer, dataset)
    return RolloutClient(actor, cfg, reward)
