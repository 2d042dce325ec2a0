"""Everything one RL run holds, started from a validated config, and stopped as a whole.

``megarl.trainer.loop`` drives a ``Run``. This module assembles the pieces (Megatron
roles, vLLM engines, the rollout manager, the colocation hand-overs, the weight sync,
the watchdog, checkpoints) and tears them down; what each piece does lives in its own
module. A failure in any phase is re-raised as
``RunFailed``, naming the step and the phase on top of the role and rank that
the worker group or engine reported.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from megarl.algorithms.kl_control import kl_controller
from megarl.config.roles import ROLE_KINDS, TRAINED_ROLES
from megarl.config.schema import RunConfig
from megarl.data.prompts import PromptDataset, prompt_dataset
from megarl.platform import current_platform
from megarl.rewards.combined import RunReward
from megarl.rollout.endpoint.bound import NoEndpoint, start_outside_endpoint
from megarl.rollout_driver.batch import RolloutBatch
from megarl.rollout_driver.engine_restarts import EngineRestarts, engine_table
from megarl.rollout_driver.service import RolloutClient, start_rollout_service
from megarl.trainer.checkpoint import CheckpointManager
from megarl.trainer.colocation import Colocation
from megarl.trainer.engine_faults import checks_since, waiting_on_engines
from megarl.trainer.evaluation import Evaluator
from megarl.trainer.metrics import MetricsLogger
from megarl.trainer.role_starts import start_side_by_side
from megarl.trainer.roles import BaseOfActor, MegatronRole, reference_is_actor_base
from megarl.utils.abort import RUN_ABORT, Aborted, wait_all
from megarl.utils.atomic import write_text_atomic
from megarl.workers.watchdog import Watchdog


class RunFailed(RuntimeError):
    """A step failed; the message names the step, the phase and what the role reported."""


def _read_inputs(cfg: RunConfig, actor_hf: Path) -> tuple[Any, RunReward, PromptDataset]:
    """The run's tokenizer, reward and prompts (read here: bad data fails now, not in the service)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(actor_hf)), RunReward(cfg.rewards), prompt_dataset(cfg.data)


def hf_folder(path: str) -> Path:
    """The HF folder (config + tokenizer) of a model path: an HF dir, a megarl checkpoint, bundled:NAME."""
    from megarl.convert.checkpoint import is_megarl_checkpoint
    from megarl.models.bundled import resolve_model_path

    resolved = resolve_model_path(path)
    return resolved / "hf" if is_megarl_checkpoint(resolved) else resolved


class Run:
    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        self.run_dir = Path(cfg.output_dir)
        self.phase_times: dict[str, float] = {}
        self.step = 0
        self.roles: dict[str, MegatronRole] = {}
        self.engines: list = []
        self.sync = None
        self.slots: dict = {}
        self.watchdog: Watchdog | None = None
        self.rollout: RolloutClient | None = None  # the rollout service (its own Ray actor)
        self.evaluator: Evaluator | None = None
        self._busy_mark = 0.0  # the engines' generation seconds at the last generation_seconds()
        self.kl_control = kl_controller(cfg.algorithm)  # kl_coef, adapted each step when algorithm.kl_target
        self.engines_start_blank = False  # random weights until the first sync (a megarl checkpoint's actor)
        self.colocation = Colocation({}, [], 0.0)  # the real one once the roles are up
        self.fleet: EngineRestarts | None = None  # replaces failed engines (rollout.max_engine_restarts)
        self.engine_version = 0  # the weight version the engines hold (0: the model's own)
        self.check_tokens = None  # sequences a replaced engine is checked on: the last batch's first two
        self.replacement_checks: list[dict[str, float]] = []  # engines replaced mid-step (engine_faults)
        self.outside = NoEndpoint()  # the endpoint for callers outside the run (rollout.endpoint.port)

    # -- construction --------------------------------------------------------------------------

    def build(self) -> Run:
        """Starts every role and engine; a failure on the way stops what had started."""
        try:
            return self._build()
        except BaseException as error:
            self.shutdown(graceful=False)
            if isinstance(error, Exception):
                raise RunFailed(f"start-up: {self._cause(error)}") from error
            raise

    def __enter__(self) -> Run:
        return self

    def __exit__(self, exc_type, *rest) -> None:
        self.shutdown(graceful=exc_type is None)

    def _build(self) -> Run:
        from megarl.cluster.placement import place
        from megarl.cluster.ray_env import ensure_ray
        from megarl.rollout.remote import wait_ready

        cfg = self.cfg
        self.run_dir.mkdir(parents=True, exist_ok=True)
        RUN_ABORT.reset()  # a run earlier in this process may have tripped it
        actor_hf = hf_folder(cfg.actor.model.path)
        with ThreadPoolExecutor(1, thread_name_prefix="megarl-inputs") as reader:
            # The tokenizer and the prompts are read while Ray's own processes start (a few
            # seconds of waiting here), not while the engines and ranks start and every core is
            # busy: ~4.6 s of this process's CPU on a 2-core machine (transformers' import 3.2 s).
            inputs = reader.submit(_read_inputs, cfg, actor_hf)
            ensure_ray()
            slots = self.slots = place(cfg)
            # vLLM reads an HF folder's weights itself; a megarl checkpoint's (an SFT stage's) it gets
            # from the first weight sync, before anything is generated (resume)
            self.engines_start_blank = not any(actor_hf.glob("*.safetensors"))
            self.engines_start_blank |= cfg.rollout.weights != "model"  # FP8 quantization happens in the sync
            self.engines = self._start_engines(actor_hf, slots["rollout"])
            tokenizer, reward, dataset = inputs.result()
        # an engine replaced before the first batch is checked on some text
        self.check_tokens = torch.tensor([tokenizer("A replaced rollout engine scores this text as the actor does.")
                                          ["input_ids"]])
        self.evaluator = Evaluator(cfg, self.engines, tokenizer, reward)  # reads every eval set: bad data fails now
        self.rollout = start_rollout_service(cfg, self.engines, tokenizer, dataset, reward)
        # paused until the first sync where the engines start without the policy's weights
        self.outside = start_outside_endpoint(cfg, self.engines, str(actor_hf), paused=self.engines_start_blank)
        if cfg.rollout.colocate_with is not None:
            # vLLM sizes its KV cache from the device's free memory as it starts: the roles that
            # share its devices load once it has, or its profile counts their weights as its own
            wait_ready(self.engines, timeout_s=cfg.trainer.step_timeout_s)
        own = [name for name in cfg.roles() if not (name == "reference" and reference_is_actor_base(cfg))]
        started = self.start_roles(own)
        for name in cfg.roles():  # in the config's order (the watchdog's, the pids')
            # a LoRA actor's reference is its base: no second copy of the weights
            self.roles[name] = started[name] if name in started else BaseOfActor(started["actor"])
        self.colocation = Colocation(self._colocated_roles(), self.engines, cfg.trainer.collective_timeout_s)
        wait_ready(self.engines, timeout_s=cfg.trainer.step_timeout_s)
        service_pid = self.rollout.pid()  # and the service is up
        self.sync = self._new_sync()
        self.checkpoints = CheckpointManager(self.run_dir)
        # which process is which rank: for `kill`, `py-spy dump` or a debugger
        pids = {name: role.group.pids for name, role in self.roles.items()} | {"rollout_service": [service_pid]}
        write_text_atomic(self.run_dir / "workers.json", json.dumps(pids, indent=2))
        self._start_watchdog(service_pid)
        self.generation_seconds()  # the steps' busy time counts from here
        return self

    def _new_sync(self):
        """The weight sync from the actor into ``self.engines``, set up (at start, and with a replaced engine)."""
        from megarl.workers.weight_sync import WeightSync

        tr = self.cfg.trainer
        sync = WeightSync(self.roles["actor"].group, "actor", self.engines, bucket_bytes=int(tr.bucket_mib * 2**20),
                          timeout_s=tr.collective_timeout_s * 4, delta=tr.delta_sync)
        sync.setup()
        return sync

    def _start_watchdog(self, service_pid: int) -> None:
        """Every rank and engine is watched from here on; engines.json says which process is which."""
        tr = self.cfg.trainer
        # An engine that does not answer for this long is hung (its process lives, but its watch
        # thread cannot run); a death is seen at the next look, within watchdog_interval_s.
        self.watchdog = Watchdog(interval_s=tr.watchdog_interval_s,
                                 answer_timeout_s=max(30.0, tr.collective_timeout_s, 10 * tr.watchdog_interval_s))
        for role in self.roles.values():
            self.watchdog.watch_group(role.group)
        engines = engine_table(self.engines, tr.collective_timeout_s)
        for index, engine in enumerate(self.engines):
            self.watchdog.watch_engine(index, engine)
        self.watchdog.watch_actor(f"the rollout service (pid {service_pid})", self.rollout.actor)
        write_text_atomic(self.run_dir / "engines.json", json.dumps(engines, indent=2))
        if self.fleet is None:
            self.fleet = EngineRestarts(self.cfg, self.engines, self.rollout, self.watchdog, self._start_engine,
                                        self._new_sync, self.run_dir)
        else:  # the roles restarted in place (megarl.trainer.restarts): the fleet's counts go on
            self.fleet.watchdog = self.watchdog
            self.fleet.sync_over()  # a sync the failure cut short is over
        self.watchdog.engine_fault = self.fleet.on_fault
        self.watchdog.start()

    def _start_engines(self, actor_hf: Path, slot) -> list:
        return [self._start_engine(i, actor_hf, slot) for i in range(self.cfg.rollout.engines)]

    def _start_engine(self, i: int, actor_hf: Path | None = None, slot=None):
        """Engine ``i`` on its placement bundle (again, for a replacement: the same settings and bundle)."""
        from megarl.rollout.backends import BACKENDS
        from megarl.rollout.remote import start_engine

        r = self.cfg.rollout
        actor_hf, slot = actor_hf or hf_folder(self.cfg.actor.model.path), slot or self.slots["rollout"]
        return start_engine(str(actor_hf), tp=r.tp, dtype=r.dtype, max_model_len=r.max_model_len,
                            engine_class=BACKENDS[r.backend].load(), max_num_seqs=r.max_num_seqs,
                            kv_cache_gib=r.kv_cache_gib, seed=self.cfg.seed,
                            gpu_memory_utilization=r.gpu_memory_utilization,
                            load_format="dummy" if self.engines_start_blank else "auto",
                            weights=r.weights, fp8_block=r.fp8_block,
                            expert_parallel=r.expert_parallel, routing_replay=self.cfg.actor.moe.routing_replay,
                            engine_core=r.engine_core, cpu_gemm=r.cpu_gemm,
                            placement_group=slot.placement_group, bundle_index=i, num_cpus=slot.cpus_per_rank,
                            num_gpus=slot.gpus_per_rank, cpu_threads=self._cpu_threads(slot))

    def _cpu_threads(self, slot) -> int | None:
        """CPU threads of each rank or engine process. Lockstep (None): all the cores, as one
        side computes while the other waits. Rollout ahead: both compute at once, so each keeps
        to the CPUs it was given, instead of twice the threads fighting over the same cores.
        ``trainer.cpu_cores: bundle`` keeps to them in lockstep too."""
        tr = self.cfg.trainer
        if current_platform().is_gpu or (tr.max_staleness == 0 and tr.cpu_cores == "auto"):
            return None
        return max(1, int(slot.cpus_per_rank))

    def start_roles(self, names: list[str]) -> dict[str, MegatronRole]:
        """The named roles, started side by side (if one fails the others are stopped)."""
        return start_side_by_side(names, self._start_named_role)

    def _start_named_role(self, name: str) -> MegatronRole:
        return self._start_role(name, self.cfg.roles()[name], self.slots[name])

    def _start_role(self, name: str, role_cfg, slot) -> MegatronRole:
        from megarl.workers import WorkerGroup

        tr = self.cfg.trainer
        group = WorkerGroup(name, role_cfg.parallel.ranks, num_cpus_per_rank=slot.cpus_per_rank,
                            num_gpus_per_rank=slot.gpus_per_rank, placement_group=slot.placement_group,
                            bundle_offset=slot.bundle_offset, collective_timeout_s=tr.collective_timeout_s,
                            threads_per_rank=self._cpu_threads(slot))
        role = MegatronRole(name, role_cfg, group, role_cfg.model.path, timeout_s=tr.step_timeout_s,
                            value_head=ROLE_KINDS[name].value_head)
        role.load(timeout_minutes=max(1, math.ceil(tr.collective_timeout_s / 60)))
        return role

    def _colocated_roles(self) -> dict[str, MegatronRole]:
        """The Megatron roles that share the rollout's bundles (none when the rollout has its own)."""
        from megarl.cluster.placement import role_hosts

        if self.cfg.rollout.colocate_with is None:
            return {}
        hosts = role_hosts(self.cfg)
        return {name: role for name, role in self.roles.items() if hosts[name] == hosts["rollout"]}

    # -- steps -------------------------------------------------------------------------------

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        started = time.perf_counter()
        # which step and phase the run is in, for whoever watches it from outside
        write_text_atomic(self.run_dir / "progress.json", json.dumps({"step": self.step, "phase": name}))
        try:
            yield
        except Exception as e:
            raise RunFailed(f"step {self.step}, phase {name!r}: {self._cause(e)}") from e
        finally:
            self.phase_times[name] = time.perf_counter() - started

    def _cause(self, error: Exception) -> str:
        """What to blame: a death the watchdog saw (or sees now) before the error it caused. A rank
        whose collective peer died fails too, and would otherwise be named instead of the peer."""
        if isinstance(error, Aborted):
            return str(error)
        found = RUN_ABORT.reason
        if found is None and self.fleet is not None and self.fleet.failed:  # taken on, yet the step could not go on
            found = next(iter(self.fleet.failed.values())).reason
        if found is None and self.watchdog is not None:
            with contextlib.suppress(Exception):
                found = self.watchdog.check(answer_timeout_s=5.0)
        return found or str(error)

    def sync_weights(self, batch: RolloutBatch | None = None) -> dict[str, float]:
        """The actor's weights (version ``self.step``) into vLLM, colocated or not; with ``batch``,
        vLLM's log-probs of a few of its sequences checked against the actor's
        (``trainer.verify_sync``). Generation still in flight is waited for first (or interrupted,
        and continued under the new weights: trainer.schedule=opportunistic)."""
        self.rollout.drain()
        replaced = self.fleet is not None and bool(self.fleet.failed)
        if replaced:  # a failed engine's replacement starts where it fits the device, takes these weights
            self.colocation.make_room()
            self.sync = self.fleet.replace_failed(self.sync, joined=self.colocation.join)
        self.colocation.to_sync()
        # no outside turn sees half-synced weights; an engine fault now ends the run
        in_sync = contextlib.nullcontext() if self.fleet is None else self.fleet.syncing()
        with self.outside.paused(self.step, self.engines), in_sync:
            report = self.sync.sync()
            wait_all([e.set_weight_version.remote(self.step) for e in self.engines],
                     self.cfg.trainer.collective_timeout_s, "recording the engines' weight version")
        self.engine_version = self.step
        if batch is not None:
            self.check_tokens = batch.tokens[:2]
        checked = None
        if replaced:  # a replacement is checked, its KV cache back, before the service hands it work
            self.colocation.after_sync()
            checked = self.verify_sync(batch, every=True)
            self.fleet.serve(self.step, from_step=self.step + 1)
        self.rollout.resume(self.step)
        self.colocation.after_sync()
        verified = checked if checked is not None else self.verify_sync(batch) if batch is not None else {}
        self.colocation.actor_off()
        if self.fleet is not None:
            verified = checks_since(self, verified) | self.fleet.metrics()
        # the refit: its time (on GPU, of the transfer, not its enqueueing) and bytes
        return verified | {"time/refit_s": report.seconds, "sync/received_bytes": float(sum(report.received.values())),
                           "sync/bytes_ratio": report.bytes_ratio} | (
            {"sync/changed_fraction": report.changed_fraction} if self.sync.delta else {})  # trainer.delta_sync

    def verify_sync(self, batch: RolloutBatch | None, every: bool = False) -> dict[str, float]:
        """``every``: whatever ``trainer.verify_sync`` says (a replaced engine is checked before it
        serves); no ``batch``: on the last one's sequences."""
        mode = self.cfg.trainer.verify_sync
        if not every and (mode == "never" or (mode == "first" and self.step > 1)):
            return {}
        tokens = batch.tokens[:2] if batch is not None else self.check_tokens
        from megarl.workers.weight_sync import sync_check_bounds

        precision, trainer = self.cfg.actor.precision, self.cfg.trainer
        actor_dtype = precision.dtype if precision.fp8 is None else "fp8"  # Transformer Engine's FP8 GEMMs
        tolerance, mult_error = sync_check_bounds((actor_dtype, self.cfg.rollout.dtype), trainer.verify_tolerance,
                                                  trainer.verify_mult_error)
        report = self.sync.verify(tokens, tolerance=tolerance, mult_error=mult_error)
        return {"sync/max_abs_logprob_diff": report.max_abs_logprob_diff,
                "sync/token_mult_prob_error": report.token_mult_prob_error}

    def evaluate(self) -> dict[str, float]:
        """The held-out sets on the engines' weights (version ``self.step``) when ``eval.*`` says this
        step is one, else {}. Between steps: the engines hold the new weights and generate nothing."""
        if not self.evaluator.due(self.step):
            return {}
        began = time.perf_counter()
        with self.phase("eval"):
            self.colocation.to_rollout()  # colocated, vLLM takes the device (after a sync it has it)
            metrics = self.evaluator.evaluate(self.step, version=self.step)
        del self.phase_times["eval"]  # not a phase of the steps that follow
        self.generation_seconds()  # nor is its generation their busy time
        return metrics | {"time/eval_s": time.perf_counter() - began}

    # -- checkpoints ---------------------------------------------------------------------------

    def trained_roles(self) -> dict[str, MegatronRole]:
        return {n: r for n, r in self.roles.items() if n in TRAINED_ROLES}

    def save(self) -> Path:
        # the batches generated ahead go into the checkpoint, finished or interrupted
        waiting_on_engines(self, self.rollout.drain)
        # the prompt stream's position ("data"), the queue's and the KL coefficient where it adapts
        state = self.rollout.state_dict() | {"kl_control": self.kl_control.state_dict()}
        with self.colocation.roles_on_device():
            saved = self.checkpoints.save(self.step, self.trained_roles(), state, write_more=self.rollout.save)
        if self.engines:
            self.rollout.resume(self.step)  # the interrupted ones go on
        return saved

    def release_inference(self) -> None:
        """Stops the engines and the roles that only score (reference, reward model) once training is
        over, so the final checkpoint saves with their memory free: megatron-core's distributed save
        holds another copy of each trained rank's state while it writes (on the 24 GiB machine, the
        MoE demo's final save pushed Ray's memory monitor into killing the reference)."""
        import ray

        self.rollout.drain()  # nothing may still be generating into the checkpoint's queue
        self.outside.stop()
        if self.watchdog is not None:
            self.watchdog.forget_engines()  # a stopped group is skipped by the watchdog already
        if self.sync is not None:
            with contextlib.suppress(Exception):
                self.sync.close()
            self.sync = None
        for name in [n for n in self.roles if n not in self.trained_roles()]:
            self.colocation.sharing.pop(name, None)
            self.roles.pop(name).shutdown()
        for engine in self.engines:
            with contextlib.suppress(Exception):
                ray.kill(engine)
        self.engines.clear()  # the rollout manager and evaluator hold this same list

    def generation_seconds(self) -> float:
        """Seconds the engines spent generating (summed over engines) since the last call."""
        total = sum(wait_all([e.busy_seconds.remote() for e in self.engines], self.cfg.trainer.collective_timeout_s,
                             "the engines' busy time"))
        # a replaced engine's count starts over: that step's time is short by the old engine's
        since, self._busy_mark = max(0.0, total - self._busy_mark), total
        return since

    def resume(self) -> int:
        """Continues from the run directory's latest checkpoint (``trainer.resume: auto``); returns its step."""
        latest = self.checkpoints.latest() if self.cfg.trainer.resume != "never" else None
        if latest is None:
            if self.engines_start_blank:  # the first rollout (and evaluation) must see the actor's weights
                self.sync_weights()
            return 0
        self.restore(latest)
        print(f"resumed from {latest} (step {self.step})", flush=True)
        return self.step

    def restore(self, checkpoint: Path, roles: bool = True) -> None:
        """The step, the KL coefficient, the prompt stream and the rollout queue as ``checkpoint``
        holds them, and (``roles``) the trained roles' state; then the engines take the actor's weights."""
        state = self.checkpoints.trainer_state(checkpoint)
        for name, role in self.trained_roles().items() if roles else ():
            role.restore(str(checkpoint / name), with_optimizer=True)
        self.step = state["step"]
        if "kl_control" in state:
            self.kl_control.load_state_dict(state["kl_control"])
        self.rollout.load(checkpoint, {"data": state["data"],
                                       "queue": state.get("queue", {"next_index": self.step + 1})})
        self.sync_weights()

    def logger(self, resume_step: int) -> MetricsLogger:
        tr = self.cfg.trainer
        return MetricsLogger(self.run_dir, asdict(self.cfg), tensorboard=tr.tensorboard, wandb=tr.wandb,
                             resume_step=resume_step, run_name=self.cfg.name)

    def shutdown(self, graceful: bool = True) -> None:
        """Stops every process of the run. After a failure (``graceful=False``) nothing is asked
        of the processes that may be blocked: vLLM's are killed, then the actors."""
        import ray

        if self.watchdog is not None:
            self.watchdog.stop()
        self.outside.stop()
        if self.sync is not None and graceful:
            with contextlib.suppress(Exception):
                self.sync.close()
        if not graceful:  # the engines' watch thread answers even while generate() blocks
            with contextlib.suppress(Exception):
                ray.wait([e.kill_processes.remote() for e in self.engines], num_returns=len(self.engines),
                         timeout=5.0)
        if self.rollout is not None:
            self.rollout.stop()
        for role in self.roles.values():
            role.shutdown(graceful=graceful)
        for engine in self.engines:
            with contextlib.suppress(Exception):
                ray.kill(engine)
        # the placement groups go last, once nothing runs in them
        for group in {id(s.placement_group): s.placement_group for s in self.slots.values()}.values():
            with contextlib.suppress(Exception):
                ray.util.remove_placement_group(group)
        RUN_ABORT.reset()
