"""OpenEnv's echo environment, as `openenv init echo_env` writes it from the template openenv-core
ships (model_configs/cpu_openenv_echo.yaml's first step), made importable for one test."""

from __future__ import annotations

from pathlib import Path

import pytest


def write_echo_env(where: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from openenv.cli.commands import init as openenv_init

    monkeypatch.setattr(openenv_init, "_generate_uv_lock", lambda env_dir: False)  # its uv lockfile: not needed
    openenv_init.init("echo_env", output_dir=str(where))
    monkeypatch.syspath_prepend(str(where))
