"""``data.source: verifiers:<environment>[@eval]``: the prompts of a ``verifiers`` environment's own
dataset (``@eval``: its ``eval_dataset``, for a held-out set), so a run on ``env.kind:
verifiers:<environment>`` trains on the task exactly as the environment defines it.

The environment is loaded as the run loads it (``vf.load_environment(id, **task_config)``; its
``load_environment`` arguments go in ``data.task_config`` / the eval set's ``task_config``). Each
row becomes a plain-text item: the row's ``question`` (the environment formats it its own way, its
system prompt and few-shot examples, when it plays the episode), with ``answer``, ``task`` and
``info`` in the metadata its rubric scores against.
"""

from __future__ import annotations

import importlib.util
from typing import Any

PREFIX = "verifiers:"
EVAL_SPLIT = "@eval"


def is_verifiers_source(source: str) -> bool:
    return source.startswith(PREFIX)


def _split(source: str) -> tuple[str, bool]:
    env_id = source[len(PREFIX):]
    held_out = env_id.endswith(EVAL_SPLIT)
    return (env_id[: -len(EVAL_SPLIT)] if held_out else env_id), held_out


def _rows(source: str, options: dict[str, Any]) -> list[dict[str, Any]]:
    env_id, held_out = _split(source)
    if not env_id:
        raise ValueError(f"{source!r} names no environment (verifiers:<environment module>[@eval])")
    if importlib.util.find_spec("verifiers") is None:
        raise ValueError(f"{source!r} needs the verifiers package (see containers/install-cpu.sh)")
    if importlib.util.find_spec(env_id.replace("-", "_")) is None:
        raise ValueError(f"{source!r}: no module {env_id.replace('-', '_')!r} is installed")
    import verifiers as vf

    try:
        env = vf.load_environment(env_id, **options)
    except Exception as exc:  # the environment's own code: any error, told in one line
        raise ValueError(f"{source!r}: load_environment failed: {exc.__cause__ or exc}") from None
    dataset = env.eval_dataset if held_out else env.dataset
    if dataset is None:
        raise ValueError(f"{source!r}: the environment has no {'eval_dataset' if held_out else 'dataset'}")
    if "question" not in dataset.column_names:
        columns = ", ".join(dataset.column_names)
        raise ValueError(f"{source!r}: its dataset has no 'question' column (columns: {columns})")
    return list(dataset)


def verifiers_questions(source: str, options: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """The environment's dataset (or eval_dataset): each row's question and its metadata (answer,
    task, info); ValueError, one line, if it cannot load (``megarl.data.prompts.from_verifiers``
    makes them prompt items)."""
    rows = [(str(row["question"]), {"answer": str(row.get("answer", "")), "task": str(row.get("task") or "default"),
                                    "info": dict(row.get("info") or {})}) for row in _rows(source, options)]
    if not rows:
        raise ValueError(f"{source!r}: the environment's dataset is empty")
    return rows
