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


def current_umask() -> int:
    """This process's umask, read without changing it (Linux), else by setting it back at once."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def make_user_readable(path: str | Path) -> None:
    """Gives ``path`` the mode of a file the user creates (0666 less the umask).

    Writers that go through a temporary file (safetensors' ``save_file``, ``mkstemp``)
    leave it 0600; an exported model must be readable the way the user's umask says.
    """
    os.chmod(path, 0o666 & ~current_umask())
