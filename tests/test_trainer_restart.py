"""Trainer faults restart in place (issue 42 item 3): what the restart relies on.
The run itself, its actor rank SIGKILLed in step 3 and restarted from a memory snapshot or a
checkpoint, is tests/test_trainer.py's ``-k restarts_in_place`` (the checkpoint's case in the run
its kill-and-resume test kills again): each repeats that module's run one version ahead.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest


def rank_tensor(mib: int, raise_it: bool = False):
    """Run on a rank: a tensor big enough to live in Ray's shared object store, not inline."""
    import torch

    if raise_it:
        raise ValueError("raised on purpose")
    return torch.arange(mib * 2**18, dtype=torch.float32)


def test_results_kept_by_run_kept_outlive_the_rank_and_a_death_is_told_from_an_error(ray_session):
    """What a memory snapshot relies on: a result left in the object store by ``run_kept`` is still
    readable once its rank's process is SIGKILLed; a rank that raises fails the call with
    ``died`` empty (no restart would help), a killed one with its rank in ``died``."""
    import ray
    import torch

    from megarl.workers.group import WorkerGroup, WorkerGroupError

    group = WorkerGroup("kept", 1, pythonpath=[str(Path(__file__).parent)])
    try:
        with pytest.raises(WorkerGroupError, match="raised on purpose") as raised:
            group.run_kept(rank_tensor, mib=1, raise_it=True)
        assert raised.value.died == [] and not group.alive
    finally:
        group.shutdown()
    group = WorkerGroup("kept", 1, pythonpath=[str(Path(__file__).parent)])
    try:
        [kept] = group.run_kept(rank_tensor, mib=4)
        os.kill(group.pids[0], signal.SIGKILL)
        with pytest.raises(WorkerGroupError, match="process died") as died:
            group.run(rank_tensor, mib=1, timeout_s=60)
        assert died.value.died == [0]
        assert torch.equal(ray.get(kept), torch.arange(2**20, dtype=torch.float32))
    finally:
        group.shutdown()
