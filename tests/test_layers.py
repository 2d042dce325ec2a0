"""The layer contracts of pyproject.toml hold, and they are not vacuous: a wrong import breaks them."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def lint_imports(subprocesses):
    def run(cwd: Path) -> subprocess.CompletedProcess:
        # lint-imports reads [tool.importlinter] from the pyproject.toml of its working directory and
        # finds the package on sys.path: the copy's directory goes first.
        env = {"PYTHONPATH": str(cwd), "PATH": str(Path(sys.executable).parent)}
        return subprocesses.run([str(Path(sys.executable).parent / "lint-imports"), "--no-cache"], cwd=cwd, env=env,
                                capture_output=True, text=True, timeout=300)

    return run


def test_layers_hold(lint_imports):
    result = lint_imports(ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert "0 broken" in result.stdout


def test_a_wrong_import_breaks_the_layers(tmp_path, lint_imports):
    shutil.copytree(ROOT / "megarl", tmp_path / "megarl", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    # the algorithms (a low layer) reaching up into the trainer
    with (tmp_path / "megarl" / "algorithms" / "kl.py").open("a") as f:
        f.write("\nfrom megarl.trainer import run  # noqa: E402,F401\n")
    result = lint_imports(tmp_path)
    assert result.returncode != 0
    assert "megarl.algorithms is not allowed to import megarl.trainer" in result.stdout, result.stdout[-3000:]
