"""JSON Lines files, read strictly: each non-blank line one JSON value, a bad line named by
``path:line`` (not UTF-8, invalid JSON, nested too deeply)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def jsonl_rows(path: str | Path, what: str = "data file") -> Iterator[tuple[str, Any]]:
    """(``path:line``, value) of every non-blank line; ``what`` names the file in errors."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{what} {path} does not exist")
    with path.open("rb") as f:  # bytes: a line that is not UTF-8 is named by its number
        for lineno, raw in enumerate(f, start=1):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
            except UnicodeDecodeError as exc:
                raise ValueError(f"{where}: not UTF-8 (byte 0x{exc.object[exc.start]:02x})") from None
            if not line.strip():
                continue
            try:
                yield where, json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{where}: invalid JSON ({exc.msg} at column {exc.colno})") from None
            except RecursionError:
                raise ValueError(f"{where}: JSON nested too deeply") from None
