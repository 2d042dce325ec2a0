"""Directories and files that appear whole or not at all."""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def atomic_dir(final: str | Path, overwrite: bool = False) -> Iterator[Path]:
    """Yields a temporary sibling of ``final`` to fill; renames it to ``final`` on success.

    On any exception the temporary directory is removed, so a failed or interrupted
    write never leaves a half-written ``final`` behind.
    """
    final = Path(final).absolute()
    if final.exists() and not overwrite:
        raise FileExistsError(f"{final} already exists; choose another output or remove it")
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".{final.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if final.exists():
        old = final.parent / f".{final.name}.old-{os.getpid()}"
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, final)


def write_text_atomic(path: str | Path, text: str) -> None:
    path = Path(path)
    tmp = path.parent / f".{path.name}.partial-{os.getpid()}"
    tmp.write_text(text)
    os.replace(tmp, path)
