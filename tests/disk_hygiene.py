"""The suite's disk use held to what the running module needs.

A run on SmolLM2 writes about 2 GB (its checkpoint with the optimizer's state); pytest keeps every
temporary folder until the session ends, so the whole suite once filled CI's disk. Each module's
folders are removed when the module ends, unless one of its tests failed (kept for a look); the
folders of session-scoped fixtures live in ``session_dir`` and stay.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest

SESSION_LIVED = "session-lived"


def session_dir(tmp_path_factory: pytest.TempPathFactory, name: str) -> Path:
    """A new folder for a session-scoped fixture, kept until the session ends."""
    root = tmp_path_factory.getbasetemp() / SESSION_LIVED
    root.mkdir(exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f"{name}-", dir=root))


@pytest.fixture(scope="module", autouse=True)
def _module_folders_removed_after_it(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    # Autouse and module-scoped: set up before the module's other fixtures, so torn down after them
    # (their engines and ranks have stopped using the folders by then).
    base = tmp_path_factory.getbasetemp()
    existing = set(base.iterdir())
    failed_before = request.session.testsfailed
    yield
    if request.session.testsfailed > failed_before:
        return
    for path in set(base.iterdir()) - existing:
        if path.name != SESSION_LIVED:
            shutil.rmtree(path, ignore_errors=True)
