"""The sandboxed process of the ``python`` tool: its limits, how it is started and stopped, and
what it leaves behind (its bounded output, how it ended, and the bootstrap's report of its
isolation). ``megarl.envs.tools.python_sandbox`` describes one call in full.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import sys
import tempfile
from dataclasses import dataclass, field
from typing import Any

from megarl.envs.tools.sandbox.bootstrap import BOOTSTRAP

_MIB = 1024 * 1024
_CHUNK = 65536
_REAP_SECONDS = 5.0  # after a kill, how long to wait for pipes to close (they close at once without escapees)
_FLOOD_FACTOR = 64  # a program that writes this many times output_bytes (at least 1 MiB) is stopped


@dataclass(frozen=True)
class SandboxLimits:
    """Per-call limits of the ``python`` tool (each a constructor option of ``PythonSandbox``)."""

    cpu_seconds: int = 5  # RLIMIT_CPU: SIGXCPU at this, SIGKILL one second later
    wall_seconds: float = 10.0  # the whole call, start-up included; then the process group is killed
    memory_mib: int = 256  # RLIMIT_AS
    output_bytes: int = 4096  # what the policy reads back of stdout+stderr
    file_size_mib: int = 16  # RLIMIT_FSIZE: no file written larger
    max_processes: int = 16  # RLIMIT_NPROC (tasks, threads included) where enforced per sandbox
    code_bytes: int = 65536  # longest accepted program

    def __post_init__(self) -> None:
        for name in ("cpu_seconds", "memory_mib", "output_bytes", "file_size_mib", "max_processes", "code_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"python sandbox option {name} must be a positive integer, got {value!r}")
        if not isinstance(self.wall_seconds, int | float) or not self.wall_seconds > 0:
            raise ValueError(f"python sandbox option wall_seconds must be positive, got {self.wall_seconds!r}")
        if self.memory_mib < 32:
            raise ValueError("python sandbox option memory_mib must be at least 32 (the interpreter needs ~20 MiB)")


async def run_program(code: str, limits: SandboxLimits, layers: dict[str, bool]) -> Run:
    """Runs ``code`` as ``main.py`` in a fresh directory under ``limits``, with the isolation ``layers``
    switched on (network_namespace, seccomp, audit_hook); the directory is deleted afterwards."""
    workdir = os.path.realpath(tempfile.mkdtemp(prefix="megarl-python-"))
    try:
        with open(os.path.join(workdir, "main.py"), "w", encoding="utf-8", errors="surrogatepass") as f:
            f.write(code)
        return await _spawn_and_wait(workdir, limits, layers)
    finally:
        # in a thread: a program may leave many files, and the event loop serves other episodes
        await asyncio.to_thread(_remove_tree, workdir)


async def _spawn_and_wait(workdir: str, limits: SandboxLimits, layers: dict[str, bool]) -> Run:
    status_read, status_write = os.pipe()
    config = {"dir": workdir, "status_fd": status_write, "cpu": limits.cpu_seconds,
              "memory": limits.memory_mib * _MIB, "fsize": limits.file_size_mib * _MIB,
              "nproc": limits.max_processes, **layers}
    try:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-I", "-S", "-B", "-c", BOOTSTRAP, json.dumps(config),
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            cwd=workdir, env={}, start_new_session=True, pass_fds=(status_write,))
    except BaseException:
        os.close(status_read)
        raise
    finally:
        os.close(status_write)
    run = Run(stdout=Capture(limits.output_bytes, tail=False), stderr=Capture(limits.output_bytes, tail=True),
              flood_bytes=max(_FLOOD_FACTOR * limits.output_bytes, _MIB), pid=proc.pid)
    assert proc.stdout is not None and proc.stderr is not None
    tasks = [asyncio.ensure_future(run.pump(proc.stdout, run.stdout)),
             asyncio.ensure_future(run.pump(proc.stderr, run.stderr)), asyncio.ensure_future(proc.wait())]
    try:
        await asyncio.wait(tasks, timeout=limits.wall_seconds)
        run.timed_out = not tasks[2].done()
    finally:
        _kill_group(proc.pid)  # also the end of any process that got past the filters
        try:
            await asyncio.wait(tasks, timeout=_REAP_SECONDS)
        finally:
            for task in tasks:
                task.cancel()  # no-op for the finished ones
            run.status = _read_status(status_read)
    run.returncode = proc.returncode
    return run


@dataclass
class Capture:
    """One pipe's bytes, bounded: the first ``keep`` bytes (stdout: the answer is usually first) or
    the last (stderr: the traceback's last line is what matters)."""

    keep: int
    tail: bool
    data: bytearray = field(default_factory=bytearray)
    total: int = 0

    def add(self, chunk: bytes) -> None:
        self.total += len(chunk)
        if self.tail:
            self.data += chunk
            del self.data[:-self.keep]
        elif len(self.data) < self.keep:
            self.data += chunk[: self.keep - len(self.data)]

    def text(self) -> str:
        return self.data.decode("utf-8", "replace")


@dataclass
class Run:
    """One sandboxed process: its output, how it ended, and what the bootstrap set up."""

    stdout: Capture
    stderr: Capture
    flood_bytes: int
    pid: int
    returncode: int | None = None
    timed_out: bool = False
    flooded: bool = False
    status: dict[str, bool] = field(default_factory=dict)

    async def pump(self, stream: asyncio.StreamReader, capture: Capture) -> None:
        """Reads a pipe to its end; a program that writes without bound is stopped (reading on
        until the pipe closes, so the transport shuts down cleanly)."""
        while chunk := await stream.read(_CHUNK):
            capture.add(chunk)
            if not self.flooded and self.stdout.total + self.stderr.total > self.flood_bytes:
                self.flooded = True
                _kill_group(self.pid)


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # already gone


def _read_status(fd: int) -> dict[str, bool]:
    """The bootstrap's one-line report of the layers it set up (empty when it died first)."""
    try:
        os.set_blocking(fd, False)
        data = os.read(fd, 4096)
    except OSError:
        data = b""
    finally:
        os.close(fd)
    try:
        status = json.loads(data)
    except ValueError:
        return {}
    return {str(k): bool(v) for k, v in status.items()} if isinstance(status, dict) else {}


def _remove_tree(path: str) -> None:
    def unlock_and_retry(function: Any, target: str, _exc: Any) -> None:
        # the program may have made its files or directories unreadable to a non-root trainer
        try:
            os.chmod(os.path.dirname(target), 0o700)
            if os.path.isdir(target) and not os.path.islink(target):
                os.chmod(target, 0o700)
            function(target)
        except OSError:
            pass

    shutil.rmtree(path, onerror=unlock_and_retry)
