"""How many CPU cores this process may run on."""

from __future__ import annotations

import os


def usable_cores() -> int:
    """The cores in this process's affinity mask (a Slurm or container limit narrows it),
    else the machine's count."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
