"""Liveness of the helper processes a long-lived process started (vLLM's engine core and workers).

A Ray actor that owns child processes can be alive while a child it waits on is dead: vLLM's
synchronous ``generate`` then waits forever on a queue nobody feeds. Ray only reports the
death of the actor's own process, so the owner snapshots its children once they are up and
checks them on request. A process counts as the same one only if its pid and start time both
match, so a recycled pid never passes for the original.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class WatchedProcess:
    pid: int
    title: str  # the process title (vLLM sets "VLLM::EngineCore", "VLLM::Worker_TP0", ...)
    create_time: float


@dataclass(frozen=True)
class ProcessDeath:
    pid: int
    title: str
    # "exited" (reaped or gone), "zombie" (dead, not yet reaped by its parent) or "stopped" (SIGSTOP:
    # alive, and every call waiting on it hangs)
    how: str

    def describe(self) -> str:
        if self.how == "stopped":
            return f"process {self.title} (pid {self.pid}) is stopped (hung)"
        return f"process {self.title} (pid {self.pid}) died"


def _title(process) -> str:
    try:
        cmdline = process.cmdline()
    except Exception:  # psutil.AccessDenied/ZombieProcess: fall back to the kernel's short name
        cmdline = []
    title = " ".join(cmdline).strip() if cmdline else ""
    return title.split()[0] if title.startswith("VLLM::") else (title or process.name())


def descendants(title_prefix: str = "", pid: int | None = None) -> list[WatchedProcess]:
    """The live descendants of ``pid`` (default: this process) whose title starts with ``title_prefix``."""
    import psutil

    found = []
    for child in psutil.Process(pid or os.getpid()).children(recursive=True):
        try:
            title = _title(child)
            if title.startswith(title_prefix):
                found.append(WatchedProcess(child.pid, title, child.create_time()))
        except psutil.NoSuchProcess:
            continue
    return found


def deaths(watched: Sequence[WatchedProcess]) -> list[ProcessDeath]:
    """Those of ``watched`` that are no longer running, or stopped."""
    import psutil

    dead = []
    for proc in watched:
        try:
            process = psutil.Process(proc.pid)
            if process.create_time() != proc.create_time:
                dead.append(ProcessDeath(proc.pid, proc.title, "exited"))
            elif (status := process.status()) == psutil.STATUS_ZOMBIE:
                dead.append(ProcessDeath(proc.pid, proc.title, "zombie"))
            elif status == psutil.STATUS_STOPPED:  # not "tracing-stop": py-spy dump pauses it a moment
                dead.append(ProcessDeath(proc.pid, proc.title, "stopped"))
        except psutil.NoSuchProcess:
            dead.append(ProcessDeath(proc.pid, proc.title, "exited"))
    return dead


def kill_all(watched: Sequence[WatchedProcess]) -> int:
    """SIGKILLs those of ``watched`` still running (same pid and start time); returns how many."""
    import psutil

    killed = 0
    for proc in watched:
        try:
            process = psutil.Process(proc.pid)
            if process.create_time() == proc.create_time:
                process.kill()
                killed += 1
        except psutil.NoSuchProcess:
            continue
    return killed
