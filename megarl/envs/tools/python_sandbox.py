"""The ``python`` tool: runs the policy's code in a separate, limited Python process and answers with
what it printed, or with a short error naming the limit it hit.

What one call does
------------------
The code is written to ``main.py`` in a fresh ``tempfile.mkdtemp`` directory (deleted afterwards)
and run by ``sys.executable -I -S -B`` (isolated mode: no PYTHON* variables, no user or venv
site-packages, no script directory on the path, no bytecode written) with that directory as cwd,
an empty environment, stdin from /dev/null and a new session (its own process group, killed whole
at the end). The code never travels through argv. Before the code runs, a small bootstrap
(``megarl.envs.tools.sandbox.bootstrap``, run inside the child) sets up, in this order, what a
``preexec_fn`` would otherwise do (a preexec_fn runs Python in the trainer's forked image, which can
deadlock on a lock another trainer thread held at fork time; the child's own bootstrap is
single-threaded):

1. a new network namespace (``unshare(CLONE_NEWUSER | CLONE_NEWNET)``, or ``CLONE_NEWNET`` alone
   where user namespaces are off): no interface but a loopback that is down, so no connection
   leaves the process, not even to localhost. The user namespace also drops every capability the
   trainer's uid holds on the host (a root trainer's child cannot raise its own limits back);
2. rlimits: CPU seconds (SIGXCPU, then SIGKILL one second later), address space (memory), file
   size (SIGXFSZ ignored, so writing past it is a Python ``OSError`` instead of a kill), no core
   files, and, inside its own user namespace only, RLIMIT_NPROC;
3. on x86-64 Linux, a seccomp filter: no fork/vfork/execve (clone only for threads), no sockets
   (only a connected AF_UNIX stream pair, which asyncio uses internally), no connect/bind, no
   signals to other processes, no ptrace or process_vm_*, no rlimit raising, no new namespaces
   or mounts, no io_uring/bpf/perf/userfaultfd/keyring calls, no hard or symbolic links;
4. an audit hook (``sys.addaudithook``) that refuses, with ``SandboxViolation``: process creation
   (os.system, os.fork, os.exec*, os.posix_spawn, subprocess), every socket event (create,
   connect, bind, getaddrinfo, ...), ctypes and a few private modules that reach around the
   interpreter, opening or listing any path outside the sandbox directory except reading the
   directories on ``sys.path`` (the standard library) and /dev/null, /dev/urandom; writing,
   renaming or deleting anything outside the sandbox directory; ``..`` in paths; links; rlimit
   changes; tracing and ``gc``'s object walks (ways to find and patch the hook itself).

RLIMIT_NPROC counts every process and thread of a uid, so outside a per-sandbox user namespace it
would count the trainer's own threads; and a uid-0 process is exempt from it even inside one.
The process bound that holds everywhere the filter runs is therefore seccomp's "no fork at all";
the audit hook refuses forks first, with a clearer message. ``max_processes`` (tasks, threads
included) applies where the kernel enforces it per sandbox: a non-root trainer with user
namespaces. The bootstrap reports which layers it set up; ``PythonSandbox.isolation`` holds the
latest report (``tests/test_tools.py`` checks each layer on its own where the machine has it).

What it does NOT protect against
--------------------------------
It is a guard against the mistakes and accidents of a policy under training (infinite loops, fork
bombs, huge allocations, stray network calls, reading the trainer's files), not a security
boundary against a determined attacker. For untrusted code from people, use a VM, gVisor or a
container with its own filesystem.

* The audit hook is Python code in the attacker's own process. CPython documents that hooks are
  not a sandbox: crafted bytecode (``marshal.loads`` of a hand-made code object, which the import
  system needs and the hook therefore allows) or any memory-safety bug in the interpreter or a C
  extension can read and write interpreter memory and disable the hook; the hook also cannot see
  work done in C without an audit event (``os.stat`` of any path reveals whether it exists, file
  descriptors opened relative to another descriptor are only partly checked).
* There is no mount namespace or chroot: once the hook is bypassed, the code sees the host's
  filesystem with the trainer's uid (the user namespace keeps that uid as owner, so a root
  trainer's files stay writable), limited only by file permissions. It can also fill the disk
  with many files each under the size limit, within its CPU time.
* Without a network namespace (kernels or containers that refuse unshare), only the seccomp
  filter and the hook block the network; without seccomp (not x86-64, or a kernel without it),
  only the hook blocks fork, exec and sockets, and RLIMIT_NPROC only where it is effective.
* Limits are per process: concurrent sandboxes together may use ``max_concurrency`` times the
  memory; CPU time is not wall time (a thread-heavy program uses several cores until its CPU
  total is spent); sandboxes run under the trainer's uid and can signal each other if the
  filter is absent.
* It reads the standard library and shares the host kernel, CPU caches and timers: side
  channels, kernel bugs and resource contention (slowing the trainer) are not addressed.
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from typing import Any

from megarl.envs.tools.base import ToolResult
from megarl.envs.tools.sandbox.output import describe
from megarl.envs.tools.sandbox.process import SandboxLimits, run_program

logger = logging.getLogger(__name__)


class PythonSandbox:
    name = "python"

    def __init__(self, cpu_seconds: int = SandboxLimits.cpu_seconds, wall_seconds: float = SandboxLimits.wall_seconds,
                 memory_mib: int = SandboxLimits.memory_mib, output_bytes: int = SandboxLimits.output_bytes,
                 file_size_mib: int = SandboxLimits.file_size_mib, max_processes: int = SandboxLimits.max_processes,
                 code_bytes: int = SandboxLimits.code_bytes, max_concurrency: int = 4):
        self.limits = SandboxLimits(cpu_seconds, wall_seconds, memory_mib, output_bytes, file_size_mib,
                                    max_processes, code_bytes)
        if not isinstance(max_concurrency, int) or isinstance(max_concurrency, bool) or max_concurrency < 1:
            raise ValueError(f"python sandbox option max_concurrency must be a positive integer, "
                             f"got {max_concurrency!r}")
        self.max_concurrency = max_concurrency
        # What the latest call's bootstrap set up: network_namespace, user_namespace, seccomp, audit_hook, nproc.
        self.isolation: dict[str, bool] = {}
        # Which layers to attempt; all on. Tests switch single layers off to check the others alone.
        self._layers = {"network_namespace": True, "seccomp": True, "audit_hook": True}
        # A semaphore belongs to one event loop, so there is one per loop, made inside it on first use.
        self._slots: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = (
            weakref.WeakKeyDictionary())

    def spec(self) -> dict[str, Any]:
        cpu, memory = self.limits.cpu_seconds, self.limits.memory_mib
        return {"type": "function", "function": {
            "name": self.name,
            "description": (f"Runs a Python 3 program (standard library only, no network, no files outside its "
                            f"working directory, {cpu} s CPU, {memory} MiB memory) and returns what it prints. "
                            "Use print() to show results."),
            "parameters": {"type": "object", "required": ["code"],
                           "properties": {"code": {"type": "string", "description": "the program's source"}}},
        }}

    async def __call__(self, arguments: dict[str, Any]) -> ToolResult:
        started = time.perf_counter()
        code = arguments.get("code") if isinstance(arguments, dict) else None
        if not isinstance(code, str):
            return ToolResult('error: "code" must be a string of Python source', error=True,
                              seconds=time.perf_counter() - started)
        if len(code.encode("utf-8", "surrogatepass")) > self.limits.code_bytes:
            return ToolResult(f"error: the program is longer than {self.limits.code_bytes} bytes", error=True,
                              seconds=time.perf_counter() - started)
        async with self._semaphore():
            run = await run_program(code, self.limits, self._layers)
        self._note_isolation(run.status)
        text, error = describe(run, self.limits)
        return ToolResult(text, error=error, seconds=time.perf_counter() - started)

    def _note_isolation(self, status: dict[str, bool]) -> None:
        if status and not self.isolation:  # the first report: say once what this machine lacks
            missing = [layer for layer, wanted in self._layers.items() if wanted and not status.get(layer)]
            if missing:
                logger.warning("python sandbox: %s unavailable on this machine; the other layers remain (see "
                               "megarl.envs.tools.python_sandbox)", ", ".join(missing))
        self.isolation = status or self.isolation

    def _semaphore(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        if (slots := self._slots.get(loop)) is None:
            slots = self._slots[loop] = asyncio.Semaphore(self.max_concurrency)
        return slots
