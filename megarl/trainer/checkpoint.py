"""Run checkpoints: every trained role plus the trainer's state, complete or absent.

Layout: ``<run>/checkpoints/step_000004/{actor,critic}/`` (megatron dist checkpoints,
each exportable with ``megarl convert mcore-to-hf``), ``trainer_state.json`` (step, data
position, rollout queue) and ``rollout_buffer.safetensors`` (batches generated ahead and not
yet trained on). The step directory is written under a temporary name and renamed when
every rank has finished; ``latest`` names the newest complete one, so a run killed mid-save
resumes from the previous checkpoint.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from megarl.utils.atomic import atomic_dir, write_text_atomic


class CheckpointManager:
    def __init__(self, run_dir: str | Path):
        self.root = Path(run_dir) / "checkpoints"

    def latest(self) -> Path | None:
        pointer = self.root / "latest"
        if not pointer.is_file():
            return None
        path = self.root / pointer.read_text().strip()
        if not (path / "trainer_state.json").is_file():
            raise FileNotFoundError(f"{pointer} names {path}, which is not a complete checkpoint")
        return path

    def save(self, step: int, roles: dict[str, Any], trainer_state: dict[str, Any],
             write_more: Callable[[Path], None] | None = None) -> Path:
        """Writes every role's checkpoint and the trainer state as one step directory
        (``write_more`` adds files of its own to it, before it is complete)."""
        self.root.mkdir(parents=True, exist_ok=True)
        final = self.root / f"step_{step:06d}"
        with atomic_dir(final, overwrite=True) as tmp:
            for name, role in roles.items():
                (tmp / name).mkdir()
                role.save(str(tmp / name))
            if write_more is not None:
                write_more(tmp)
            (tmp / "trainer_state.json").write_text(json.dumps({"step": step, **trainer_state}, indent=2))
        write_text_atomic(self.root / "latest", final.name)
        return final

    @staticmethod
    def trainer_state(path: Path) -> dict[str, Any]:
        return json.loads((path / "trainer_state.json").read_text())
