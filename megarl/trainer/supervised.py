"""The supervised stages' loop: SFT, reward-model training and DPO on megatron-core groups.

One loop for the three (the stage picks the rank update and the held-out measure); the data,
micro-batching, optimizer, checkpoints, metrics and resume are the RL trainer's. Every record is
read and tokenized before any process starts, so bad data fails with its file and line first.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from megarl.algorithms.bradley_terry import bradley_terry_loss
from megarl.algorithms.dpo import PairLogprobs, dpo_loss
from megarl.algorithms.kto import kl_reference_point, kto_loss
from megarl.config.supervised import SupervisedConfig
from megarl.data.supervised import (
    KtoExample,
    PairExample,
    SftExample,
    batch_indices,
    collate,
    example_seqs,
    kto_batch,
    kto_kl_rows,
    load_examples,
    pair_batch,
)
from megarl.trainer.checkpoint import CheckpointManager
from megarl.trainer.metrics import MetricsLogger
from megarl.trainer.roles import MegatronRole
from megarl.workers import preference_fns, rl_fns
from megarl.workers.rank_batch import RankBatch
from megarl.workers.rank_results import gather_shards

UPDATES = {"sft": preference_fns.train_sft, "rm": preference_fns.train_reward_model, "dpo": preference_fns.train_dpo}


def is_kto(cfg: SupervisedConfig) -> bool:
    """``megarl dpo`` with ``dpo.loss_type: kto`` (``megarl.algorithms.kto``): on unpaired answers,
    or on pairs as two unpaired answers each, the chosen desirable and the rejected undesirable."""
    return cfg.stage == "dpo" and cfg.dpo.loss_type == "kto"


def update_fn(cfg: SupervisedConfig):
    return preference_fns.train_kto if is_kto(cfg) else UPDATES[cfg.stage]


@dataclass
class StageData:
    train: list[SftExample] | list[PairExample] | list[KtoExample]
    eval: list[SftExample] | list[PairExample] | list[KtoExample]
    pad_id: int

    @property
    def eval_rows_per_example(self) -> int:
        """Batch rows of one held-out example: 2 for a preference pair, 1 for an SFT or unpaired KTO
        one (KTO's held-out file may be of the other kind than its training file)."""
        return len(example_seqs(self.eval[0])) if self.eval else 1


def load_stage_data(cfg: SupervisedConfig, tokenizer: Any) -> StageData:
    """The train and held-out examples, tokenized; raises DataError naming a bad record."""
    from megarl.data.supervised import DataError

    d = cfg.data

    def load(source: str, size: int) -> list:
        return load_examples(source, cfg.stage, tokenizer, d.max_len, size=size, seed=d.seed,
                             instruction=d.instruction, task_config=d.task_config)

    train = load(d.train, d.size)
    if d.eval:
        held_out = load(d.eval, d.eval_size)
    else:
        held_out, train = train[len(train) - d.eval_size:] if d.eval_size else [], train[:len(train) - d.eval_size]
    if len(train) < d.batch_size:
        raise DataError(f"data.train: {len(train)} training examples (after holding out {len(held_out)}) are fewer "
                        f"than data.batch_size={d.batch_size}")
    for field, examples in (("data.train", train), ("data.eval", held_out)):
        if examples and isinstance(examples[0], KtoExample) and not is_kto(cfg):
            raise DataError(f"{field}: unpaired records ({{prompt, completion, label}}) train with "
                            f"`megarl dpo` and dpo.loss_type: kto, not {cfg.stage}"
                            + (f" loss_type {cfg.dpo.loss_type}" if cfg.stage == "dpo" else ""))
    per_step = cfg.model.rows_per_step_split()
    if train and isinstance(train[0], KtoExample) and per_step and d.batch_size % per_step:
        # one row per example: the config checks (validate_supervised) counted two per pair
        raise DataError(f"data.batch_size={d.batch_size} unpaired answers per step are not a multiple of "
                        f"model.micro_batch_size x data-parallel ranks = {per_step}")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return StageData(train, held_out, int(pad))


def total_steps(cfg: SupervisedConfig, examples: int) -> int:
    return cfg.trainer.steps or cfg.trainer.epochs * (examples // cfg.data.batch_size)


def make_batch(cfg: SupervisedConfig, examples: list, pad_id: int) -> RankBatch:
    """The rank batch of ``examples`` with the step's normaliser (completion tokens, pairs, or
    KTO's answers: one row per unpaired example, two per pair)."""
    if cfg.stage == "sft":
        batch = RankBatch(**collate([e.seq for e in examples], pad_id))
        batch.denoms = [float(batch.mask.sum())]
    elif is_kto(cfg):  # KTO's loss is a mean over answers
        batch = RankBatch(**kto_batch(examples, pad_id))
        batch.denoms = [float(len(batch.desirable))]
    else:
        batch = RankBatch(**pair_batch(examples, pad_id))
        batch.denoms = [float(len(examples))]
    return batch


class SupervisedRun:
    def __init__(self, cfg: SupervisedConfig, data: StageData):
        self.cfg, self.data = cfg, data
        self.run_dir = Path(cfg.output_dir)
        self.roles: dict[str, MegatronRole] = {}
        self.checkpoints = CheckpointManager(self.run_dir)
        # DPO / KTO: the frozen reference's per-token log-probs of each of an example's answers
        # (a pair's chosen and rejected; an unpaired answer), kept for the held-out examples
        # (computed once), and for all pairs with dpo.precompute_reference
        self._reference: dict[PairExample | KtoExample, tuple[torch.Tensor, ...]] = {}

    def __enter__(self) -> SupervisedRun:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def start(self) -> SupervisedRun:
        from megarl.cluster.ray_env import ensure_ray

        ensure_ray()
        try:
            self.roles["model"] = self._role("model", self.cfg.model, value_head=self.cfg.stage == "rm")
            if self.cfg.stage == "dpo":
                self.roles["reference"] = self._role("reference", self.reference_config())
                if self.cfg.dpo.precompute_reference:  # every pair once; then the group's resources go
                    self._remember_reference(self.data.train + self.data.eval)
                    self.roles.pop("reference").shutdown()
        except BaseException:
            self.shutdown()
            raise
        return self

    def reference_config(self):
        ref = self.cfg.reference
        return ref if ref is not None else replace(self.cfg.model)

    def _role(self, name: str, role_cfg, value_head: bool = False) -> MegatronRole:
        from megarl.platform import current_platform
        from megarl.workers import WorkerGroup

        tr = self.cfg.trainer
        group = WorkerGroup(f"{self.cfg.stage}-{name}", role_cfg.parallel.ranks,
                            num_cpus_per_rank=role_cfg.cpus_per_rank,
                            num_gpus_per_rank=role_cfg.gpus_per_rank if current_platform().is_gpu else 0,
                            collective_timeout_s=tr.collective_timeout_s)
        role = MegatronRole(name, role_cfg, group, role_cfg.model.path, timeout_s=tr.step_timeout_s,
                            value_head=value_head, new_value_head=value_head)
        role.load(timeout_minutes=max(1, math.ceil(tr.collective_timeout_s / 60)))
        return role

    def resume(self) -> int:
        """The step to continue after (0: a fresh run), the model and optimizer restored from it."""
        latest = self.checkpoints.latest() if self.cfg.trainer.resume == "auto" else None
        if latest is None:
            return 0
        self.roles["model"].restore(str(latest / "model"), with_optimizer=True)
        return int(CheckpointManager.trainer_state(latest)["step"])

    # -- one step, one evaluation ----------------------------------------------------------------

    def train_step(self, step: int) -> dict[str, float]:
        """Optimizer step ``step`` (from 1) on its examples."""
        d = self.cfg.data
        examples = [self.data.train[i] for i in batch_indices(len(self.data.train), d.batch_size, step - 1, d.seed)]
        batch = make_batch(self.cfg, examples, self.data.pad_id)
        if self.cfg.stage == "dpo":
            batch.ref_logprobs = self._reference_logprobs(examples, batch)
        if is_kto(self.cfg):
            batch.kto_kl = self._kto_reference_point(examples)
        metrics, _ = self.roles["model"].train(update_fn(self.cfg), batch,
                                               self.cfg.dpo if self.cfg.stage == "dpo" else None)
        metrics["data/completion_tokens"] = float(batch.mask.sum())
        return metrics

    def _kto_reference_point(self, examples: list[PairExample] | list[KtoExample]) -> float:
        """KTO's KL estimate ``z`` for a batch: the policy's (before the step) and the reference's
        log-probs of its mismatched rows (``kto_kl_rows``). The whole batch's rows are needed
        before any micro-batch's loss, hence its own forward passes first (TRL's too)."""
        rows = RankBatch(**kto_kl_rows(examples, self.data.pad_id, self.cfg.data.max_len))
        mask = rows.mask
        policy = (self._logprobs("model", rows) * mask).sum(1)
        ref = (self._logprobs("reference", rows) * mask).sum(1)
        return kl_reference_point(policy, ref)

    def _logprobs(self, role: str, batch: RankBatch) -> torch.Tensor:
        r = self.roles[role]
        return gather_shards(r._run(rl_fns.logprobs, key=role, batch=batch, micro_batch_size=r.cfg.micro_batch_size))

    def _reference_logprobs(self, examples: list[PairExample] | list[KtoExample], batch: RankBatch
                            ) -> torch.Tensor:
        """The reference's per-token log-probs [rows, L-1] of ``batch`` (``examples``'s rows): from
        the remembered ones where every example has them, else from the reference group."""
        if not all(e in self._reference for e in examples):
            return self._logprobs("reference", batch)
        out = torch.zeros(batch.tokens.shape[0], batch.tokens.shape[1] - 1)
        rows = (lp for e in examples for lp in self._reference[e])
        for row, lp in enumerate(rows):
            out[row, :len(lp)] = lp
        return out

    def _remember_reference(self, examples: list[PairExample] | list[KtoExample]) -> None:
        """Computes and keeps the reference's log-probs of ``examples``, in step-sized batches (the
        last filled up with repeats of its first example, whose results are not kept twice)."""
        size = self.cfg.data.batch_size
        for start in range(0, len(examples), size):
            chunk = examples[start:start + size]
            padded = chunk + [chunk[0]] * (size - len(chunk))
            lp = self._logprobs("reference", make_batch(self.cfg, padded, self.data.pad_id))
            row = 0
            for example in chunk:
                seqs = example_seqs(example)
                self._reference[example] = tuple(lp[row + i, :len(s.tokens) - 1].clone() for i, s in enumerate(seqs))
                row += len(seqs)

    def _scores(self, batch: RankBatch) -> torch.Tensor:
        r = self.roles["model"]
        return gather_shards(r._run(rl_fns.scores, key="model", batch=batch, micro_batch_size=r.cfg.micro_batch_size))

    def eval_batches(self) -> list[list]:
        """The held-out examples in batches the layout takes (whole micro-batches on every rank);
        a remainder smaller than that is left out."""
        par, mbs = self.cfg.model.parallel, self.cfg.model.micro_batch_size
        per = max(1, (par.data_parallel_size * mbs) // self.data.eval_rows_per_example)
        size = max(per, self.cfg.data.batch_size // per * per)
        n = len(self.data.eval) // per * per
        return [self.data.eval[i:i + size] for i in range(0, n, size)]

    def evaluate(self) -> dict[str, float]:
        """The held-out measure: SFT the completion tokens' mean NLL; RM and DPO the loss (KTO's per
        answer, its reference point from each held-out batch's KL rows) and the fraction of pairs
        ranked right (``eval/heldout/accuracy``; KTO on pairs: the chosen answer's log-ratio the
        higher; unpaired answers have no pairs to rank)."""
        batches = self.eval_batches()
        if not batches:
            return {}
        totals = {"loss": 0.0, "accuracy": 0.0, "count": 0.0}
        kl = 0.0  # KTO's reference point of the held-out batch
        for examples in batches:
            batch = make_batch(self.cfg, examples, self.data.pad_id)
            if self.cfg.stage == "sft":
                lp = self._logprobs("model", batch)
                totals["loss"] += float(-(lp * batch.mask).sum())
                totals["count"] += float(batch.mask.sum())
                continue
            n = len(examples)
            if self.cfg.stage == "rm":
                scores = self._scores(batch)
                loss, m = bradley_terry_loss(scores[0::2], scores[1::2], denom=1.0)
                totals["accuracy"] += float(m["rm/accuracy"])
            else:
                if not all(p in self._reference for p in examples):
                    self._remember_reference(examples)
                mask = batch.mask
                policy = (self._logprobs("model", batch) * mask).sum(1)
                ref, tokens = (self._reference_logprobs(examples, batch) * mask).sum(1), mask.sum(1)
                if is_kto(self.cfg):
                    # a last batch of one example has no other prompt's answers: the previous batch's z
                    kl = self._kto_reference_point(examples) if n > 1 else kl
                    # per example: an unpaired answer's loss, half of a pair's two (the mean per answer)
                    answers = self.data.eval_rows_per_example
                    loss, _ = kto_loss(policy, ref, batch.desirable, kl, self.cfg.dpo, denom=float(answers))
                    ratio = policy - ref
                    if answers == 2:
                        totals["accuracy"] += float((ratio[0::2] > ratio[1::2]).float().sum())
                else:
                    pairs = PairLogprobs(policy[0::2], policy[1::2], ref[0::2], ref[1::2], tokens[0::2],
                                         tokens[1::2])
                    loss, m = dpo_loss(pairs, self.cfg.dpo, denom=1.0)
                    totals["accuracy"] += float(m["dpo/accuracy"])
            totals["loss"] += float(loss)
            totals["count"] += n
        out = {"eval/heldout/loss": totals["loss"] / totals["count"], "eval/heldout/examples": float(
            sum(len(b) for b in batches))}
        if self.data.eval_rows_per_example == 2:  # pairs to rank (not SFT, not unpaired KTO answers)
            out["eval/heldout/accuracy"] = totals["accuracy"] / totals["count"]
        return out

    def save(self, step: int, final: bool = False) -> Path:
        """A checkpoint of the model; the last one is also ``<output_dir>/final`` (a link the next
        stage's recipe can name: a megarl checkpoint, exportable with ``megarl convert``)."""
        path = self.checkpoints.save(step, {"model": self.roles["model"]}, {"stage": self.cfg.stage})
        if final:
            link, tmp = self.run_dir / "final", self.run_dir / ".final.tmp"
            tmp.unlink(missing_ok=True)
            tmp.symlink_to((path / "model").relative_to(self.run_dir))
            tmp.replace(link)  # atomic: the link names the old checkpoint or the new one
        return path

    def shutdown(self) -> None:
        for role in self.roles.values():
            role.shutdown()
        self.roles.clear()


def run_stage(cfg: SupervisedConfig, data: StageData) -> list[dict[str, Any]]:
    """Trains ``cfg.stage`` to its last step (resuming from the latest checkpoint) and returns the
    metrics history."""
    tr = cfg.trainer
    last = total_steps(cfg, len(data.train))
    with SupervisedRun(cfg, data) as run:
        start = run.resume()
        logger = MetricsLogger(run.run_dir, asdict(cfg), tensorboard=tr.tensorboard, resume_step=start,
                               run_name=cfg.name)
        try:
            if start == 0:
                logger.log(0, run.evaluate())  # the held-out measure before training
            for step in range(start + 1, last + 1):
                began = time.perf_counter()
                metrics = run.train_step(step)
                metrics["time/step_s"] = time.perf_counter() - began
                if step == last or (tr.eval_every and step % tr.eval_every == 0):
                    metrics |= run.evaluate()
                logger.log(step, metrics)
                if step == last or (tr.checkpoint_every and step % tr.checkpoint_every == 0):
                    run.save(step, final=step == last)
        finally:
            logger.close()
        return logger.history()

