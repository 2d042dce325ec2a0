"""Checks of a supervised-stage config (``megarl sft / rm / dpo``) before any process starts; every
message names the dotted field. The data are read and tokenized by ``megarl.trainer.supervised``
right after, also before any process starts, naming the file and line of a bad record."""

from __future__ import annotations

from megarl.config.loader import enumeration_errors
from megarl.config.supervised import STAGES, SupervisedConfig
from megarl.platform import Platform, current_platform
from megarl.validation.checks import output_dir_errors, refuse
from megarl.validation.ranges import out_of_range
from megarl.validation.role_checks import role_model_errors


def _ranges(cfg: SupervisedConfig) -> list[str]:
    d, tr = cfg.data, cfg.trainer
    checks = [("data.batch_size", d.batch_size, "[1, inf)"), ("data.max_len", d.max_len, "[2, inf)"),
              ("data.eval_size", d.eval_size, "[0, inf)"), ("data.size", d.size, "[1, inf)"),
              ("trainer.steps", tr.steps, "[0, inf)"), ("trainer.epochs", tr.epochs, "[1, inf)"),
              ("trainer.eval_every", tr.eval_every, "[0, inf)"),
              ("trainer.checkpoint_every", tr.checkpoint_every, "[0, inf)"),
              ("trainer.step_timeout_s", tr.step_timeout_s, "(0, inf)"),
              ("trainer.collective_timeout_s", tr.collective_timeout_s, "(0, inf)"),
              ("model.micro_batch_size", cfg.model.micro_batch_size, "[1, inf)")]
    return [e for e in (out_of_range(*c) for c in checks) if e]


def _source_errors(field: str, source: str) -> list[str]:
    from pathlib import Path

    from megarl.data.hf_datasets import is_hf_source, source_errors

    if not source or source.startswith("reasoning_gym:"):
        return [] if source else [f"{field} is empty"]
    if is_hf_source(source):
        return source_errors(field, source)
    if not Path(source).is_file():
        return [f"{field}={source!r} is not a file (a JSONL or Parquet file, hf:<dataset>[@split] or "
                "reasoning_gym:<task>)"]
    return []


def _batch_errors(cfg: SupervisedConfig) -> list[str]:
    role = cfg.model
    pairs = cfg.stage != "sft"
    rows = cfg.data.batch_size * (2 if pairs else 1)
    per_step = role.rows_per_step_split()
    errors = []
    if per_step and rows % per_step:
        errors.append(f"data.batch_size={cfg.data.batch_size} gives {rows} sequences per step, not a multiple of "
                      f"model.micro_batch_size x data-parallel ranks = {per_step}")
    if role.parallel.cp > 1 and role.pack_sequences:
        errors.append(f"model.pack_sequences needs model.parallel.cp=1 (packed rows are not split over "
                      f"context-parallel ranks; cp={role.parallel.cp} splits right-padded rows)")
    if cfg.stage == "dpo" and cfg.dpo.loss_type == "kto":  # unpaired rows: any micro-batching
        if cfg.data.batch_size < 2:
            errors.append("data.batch_size must be at least 2 for dpo.loss_type kto: its KL rows pair each prompt "
                          "with another pair's answers")
    elif pairs:
        if role.micro_batch_size % 2:
            errors.append(f"model.micro_batch_size={role.micro_batch_size} must be even: a pair's two answers share "
                          "a micro-batch")
        if role.max_tokens_per_microbatch is not None or role.pack_sequences:
            errors.append("model.max_tokens_per_microbatch and model.pack_sequences would split preference pairs; "
                          "leave them unset for rm and dpo")
    return errors


def validate_supervised(cfg: SupervisedConfig, platform: Platform | None = None) -> None:
    """Raises ConfigError listing every problem of ``cfg``."""
    platform = platform or current_platform()
    if cfg.stage not in STAGES:
        refuse([f"stage={cfg.stage!r} must be one of {', '.join(STAGES)}"])
    refuse(enumeration_errors(cfg) + _ranges(cfg) + output_dir_errors(cfg.output_dir))
    errors: list[str] = []
    roles = {"model": cfg.model}
    if cfg.stage == "dpo":
        errors += cfg.dpo.problems()
        if cfg.reference is not None:
            roles["reference"] = cfg.reference
    elif cfg.reference is not None:
        errors.append(f"reference is set but {cfg.stage} uses no reference model (dpo does)")
    role_errors = [e for name, role in roles.items() for e in role_model_errors(name, role, platform)[1]]
    errors += role_errors
    errors += _source_errors("data.train", cfg.data.train)
    if cfg.data.eval:
        errors += _source_errors("data.eval", cfg.data.eval)
    if not role_errors:  # the batch arithmetic needs a sound layout
        errors += _batch_errors(cfg)
    refuse(errors)
