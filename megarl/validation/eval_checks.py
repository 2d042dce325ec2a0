"""Checks of the ``eval`` section (held-out evaluation); every message names its dotted field.

``eval_ranges`` and ``eval_setting_errors`` read the config only and run with the other range
checks; ``eval_errors`` reads the sets' data as the run will, once the rest is known to be sound.
"""

from __future__ import annotations

import math

from megarl.config.schema import RunConfig
from megarl.data.prompts import instruction_problem

# A set's name becomes part of its metrics' keys (eval/<name>/accuracy) and of TensorBoard's tags.
_NAME_FORBIDDEN = "/ \t\n"


def eval_ranges(cfg: RunConfig) -> list[tuple[str, float | None, str]]:
    """(field, value, interval) of every eval number, for ``ranges.out_of_range``."""
    checks: list[tuple[str, float | None, str]] = [
        ("eval.every", cfg.eval.every, "[0, inf)"),
        ("eval.correct_threshold", cfg.eval.correct_threshold, "(-inf, inf)"),
    ]
    for i, s in enumerate(cfg.eval.sets):
        where = f"eval.sets[{i}]"
        checks += [
            (f"{where}.size", s.size, "[1, inf)"),
            (f"{where}.max_prompt_len", s.max_prompt_len, "[1, inf)"),
            (f"{where}.samples", s.samples, "[1, inf)"),
            (f"{where}.temperature", s.temperature, "[0, inf)"),
            (f"{where}.max_tokens", s.max_tokens, "[1, inf)"),
        ]
    return checks


def eval_setting_errors(cfg: RunConfig) -> list[str]:
    """Names, sources and sampling settings that cannot work together; no file is read."""
    errors: list[str] = []
    seen: dict[str, int] = {}
    for i, s in enumerate(cfg.eval.sets):
        where = f"eval.sets[{i}]"
        if not s.name:
            errors.append(f"{where}.name is not set (metrics are named eval/<name>/...)")
        elif any(c in s.name for c in _NAME_FORBIDDEN):
            errors.append(f"{where}.name={s.name!r} must not contain '/' or spaces (it names the metrics)")
        elif s.name in seen:
            errors.append(f"{where}.name={s.name!r} is also eval.sets[{seen[s.name]}].name; names must be unique")
        else:
            seen[s.name] = i
        if not s.source:
            errors.append(f"{where}.source is not set ('reasoning_gym:<task>' or a JSONL / Parquet file)")
        # greedy samples of one prompt are all the same: k of them would only repeat sample 0
        if s.samples > 1 and math.isfinite(s.temperature) and s.temperature <= 0:
            errors.append(f"{where}.samples={s.samples} needs {where}.temperature > 0 (greedy samples are all "
                          "the same); set samples: 1 for greedy evaluation")
        if problem := instruction_problem(f"{where}.instruction", s.source, s.instruction):
            errors.append(problem)
    return errors


def eval_errors(cfg: RunConfig) -> list[str]:
    """The sets' sources (read as the run reads them), their fit in the engines' context, a reward
    that can score them, and reasoning-gym entries shared with the training data."""
    if not cfg.eval.sets:
        return []
    errors: list[str] = []
    if all(term.kind == "model" for term in cfg.rewards):
        errors.append("eval.sets: evaluation scores with the rule and remote reward terms, and rewards has only "
                      "a reward model (which scores training batches only); add a rule term or remove eval.sets")
    for i, s in enumerate(cfg.eval.sets):
        where = f"eval.sets[{i}]"
        max_tokens = cfg.rollout.max_tokens if s.max_tokens is None else s.max_tokens
        if s.max_prompt_len + max_tokens > cfg.rollout.max_model_len:
            errors.append(f"{where}: max_prompt_len + max_tokens = {s.max_prompt_len + max_tokens} exceeds "
                          f"rollout.max_model_len={cfg.rollout.max_model_len}")
        errors += _overlap_errors(cfg, i)
        errors += _source_errors(cfg, i)
    return errors


def _overlap_errors(cfg: RunConfig, i: int) -> list[str]:
    """reasoning-gym draws entry j from random.Random(seed + j): the same task and options with
    overlapping seed ranges give the same entries to training and evaluation."""
    s, data = cfg.eval.sets[i], cfg.data
    if not (s.source == data.source and s.source.startswith("reasoning_gym:") and s.task_config == data.task_config):
        return []
    if s.seed < data.seed + data.size and data.seed < s.seed + s.size:
        return [f"eval.sets[{i}].seed={s.seed}: its entries (reasoning-gym seeds {s.seed}..{s.seed + s.size - 1}) "
                f"overlap the training data's (data.seed={data.seed}, data.size={data.size}); pick a seed >= "
                f"{data.seed + data.size}"]
    return []


def _source_errors(cfg: RunConfig, i: int) -> list[str]:
    from megarl.data.prompts import prompt_dataset

    s, where = cfg.eval.sets[i], f"eval.sets[{i}]"
    if not s.source.startswith("reasoning_gym:"):
        try:
            prompt_dataset(s.data_config())  # every row of the file, as the run reads it
        except (ValueError, OSError, ImportError) as e:
            return [f"{where}.source: {' '.join(str(e).split())}"]
        return []
    import reasoning_gym

    task = s.source.split(":", 1)[1]
    if task not in reasoning_gym.factory.DATASETS:
        return [f"{where}.source: reasoning-gym has no task {task!r}"]
    try:
        prompt_dataset(s.data_config())  # the whole set: generating it takes milliseconds
    except Exception as e:  # noqa: BLE001 - a third-party task refuses its options with any exception type
        return [f"{where}.task_config: reasoning-gym task {task!r} refuses it: {' '.join(str(e).split())}"]
    return []
