"""Records from a Hugging Face dataset: ``hf:<hub id or saved folder>[@<split>]``.

A folder written by ``datasets``' ``save_to_disk`` loads from disk (a ``DatasetDict``'s split is
chosen with ``@split``, default ``train``); anything else is a Hub dataset name that
``datasets.load_dataset`` fetches or finds in its cache. Each row becomes a record named
``hf:<name>@<split> row <i>``, so a bad one is refused naming it, as a JSONL line would be.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from megarl.data.errors import DataError

PREFIX = "hf:"


def is_hf_source(source: str) -> bool:
    return source.startswith(PREFIX)


def split_source(source: str) -> tuple[str, str]:
    """(name or folder, split) of an ``hf:`` source; the split defaults to ``train``."""
    body = source[len(PREFIX):]
    name, _, split = body.partition("@")
    return name, split or "train"


def source_errors(field: str, source: str) -> list[str]:
    """What can be said of an ``hf:`` source before loading it: a name, and ``datasets`` installed."""
    import importlib.util

    name, _ = split_source(source)
    if not name:
        return [f"{field}={source!r} names no dataset (hf:<hub id or saved folder>[@split])"]
    if importlib.util.find_spec("datasets") is None:
        return [f"{field}={source!r} needs the datasets package (pip install datasets)"]
    return []


def hf_rows(source: str) -> list[tuple[str, Any]]:
    """(where, record) of every row of the dataset's split."""
    name, split = split_source(source)
    try:
        import datasets
    except ImportError:
        raise DataError(f"{source}: reading a Hugging Face dataset needs the datasets package") from None
    try:
        if Path(name).is_dir():
            loaded = datasets.load_from_disk(name)
            if isinstance(loaded, datasets.DatasetDict):
                if split not in loaded:
                    raise DataError(f"{source}: the dataset in {name} has no split {split!r} "
                                    f"(it has {', '.join(sorted(loaded))})")
                loaded = loaded[split]
        else:
            loaded = datasets.load_dataset(name, split=split)
    except DataError:
        raise
    except Exception as e:  # noqa: BLE001 - datasets raises many kinds; the user needs the one line
        raise DataError(f"{source}: could not load the dataset: {type(e).__name__}: {str(e).splitlines()[0]}") from None
    where = f"hf:{name}@{split}"
    return [(f"{where} row {i}", row) for i, row in enumerate(loaded)]
