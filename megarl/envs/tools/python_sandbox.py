"""The ``python`` tool: runs the policy's code in a separate, limited Python process and answers with
what it printed, or with a short error naming the limit it hit.

What one call does
------------------
The code is written to ``main.py`` in a fresh ``tempfile.mkdtemp`` directory (deleted afterwards)
and run by ``sys.executable -I -S -B`` (isolated mode: no PYTHON* variables, no user or venv
site-packages, no script directory on the path, no bytecode written) with that directory as cwd,
an empty environment, stdin from /dev/null and a new session (its own process group, killed whole
at the end). The code never travels through argv. Before the code runs, a small bootstrap
(``_BOOTSTRAP``, run inside the child) sets up, in this order, what a ``preexec_fn`` would
otherwise do (a preexec_fn runs Python in the trainer's forked image, which can deadlock on a lock
another trainer thread held at fork time; the child's own bootstrap is single-threaded):

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
import json
import logging
import os
import re
import shutil
import signal
import sys
import tempfile
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

from megarl.envs.tools.base import ToolResult

logger = logging.getLogger(__name__)

_MIB = 1024 * 1024
_CHUNK = 65536
_REAP_SECONDS = 5.0  # after a kill, how long to wait for pipes to close (they close at once without escapees)
_ERROR_OUTPUT_BYTES = 512  # what an error text shows of the output printed before the error
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
            run = await self._execute(code)
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

    async def _execute(self, code: str) -> Run:
        workdir = os.path.realpath(tempfile.mkdtemp(prefix="megarl-python-"))
        try:
            with open(os.path.join(workdir, "main.py"), "w", encoding="utf-8", errors="surrogatepass") as f:
                f.write(code)
            return await self._spawn_and_wait(workdir)
        finally:
            # in a thread: a program may leave many files, and the event loop serves other episodes
            await asyncio.to_thread(_remove_tree, workdir)

    async def _spawn_and_wait(self, workdir: str) -> Run:
        limits = self.limits
        status_read, status_write = os.pipe()
        config = {"dir": workdir, "status_fd": status_write, "cpu": limits.cpu_seconds,
                  "memory": limits.memory_mib * _MIB, "fsize": limits.file_size_mib * _MIB,
                  "nproc": limits.max_processes, **self._layers}
        try:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-I", "-S", "-B", "-c", _BOOTSTRAP, json.dumps(config),
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


def describe(run: Run, limits: SandboxLimits) -> tuple[str, bool]:
    """The text the policy reads, and whether it is an error."""
    stdout, stderr = run.stdout.text(), _strip_noise(run.stderr.text())
    if run.timed_out:
        return _error(f"time limit ({_number(limits.wall_seconds)} s wall clock) exceeded", stdout), True
    if run.flooded:
        return _error(f"output limit exceeded (the program wrote more than {run.flood_bytes} bytes and was "
                      "stopped)", stdout), True
    code = run.returncode if run.returncode is not None else -signal.SIGKILL
    if code < 0:
        return _error(_signal_message(-code, limits), stdout), True
    if code > 0:
        return _error(_exit_message(code, stderr, limits), stdout), True
    return _clean_output(run, stderr, limits), False


def _signal_message(number: int, limits: SandboxLimits) -> str:
    # SIGKILL that is not ours (timeouts and floods are reported above) is RLIMIT_CPU's hard limit
    if number in (signal.SIGXCPU, signal.SIGKILL):
        return f"time limit ({limits.cpu_seconds} s CPU) exceeded"
    if number == signal.SIGXFSZ:
        return f"file size limit ({limits.file_size_mib} MiB) exceeded"
    try:
        name = signal.Signals(number).name
    except ValueError:
        name = f"signal {number}"
    return f"the program was killed by {name} (a crash; the memory limit is {limits.memory_mib} MiB)"


def _exit_message(code: int, stderr: str, limits: SandboxLimits) -> str:
    last = _last_line(stderr)
    where = _main_line(stderr)
    if last.startswith("MemoryError"):
        return f"memory limit ({limits.memory_mib} MiB) exceeded{where}"
    if last.startswith("SandboxViolation:"):
        return f"forbidden operation: {last.removeprefix('SandboxViolation:').strip()}{where}"
    if "[Errno 27]" in last:  # EFBIG: RLIMIT_FSIZE with SIGXFSZ ignored
        return f"file size limit ({limits.file_size_mib} MiB) exceeded{where}"
    if not last:
        return f"the program exited with code {code}"
    return f"{last}{where}"


def _clean_output(run: Run, stderr: str, limits: SandboxLimits) -> str:
    note = ""
    if stderr.strip():
        note = "\n[stderr]\n" + _clip_tail(stderr.strip(), limits.output_bytes // 4)
    budget = max(limits.output_bytes - len(note.encode()), limits.output_bytes // 2)
    out = _clip_head(run.stdout.text().rstrip(), budget, run.stdout.total)
    if not out and not note:
        return "[no output; print() the result to see it]"
    return out + note


def _error(message: str, stdout: str) -> str:
    text = f"error: {message}"
    if stdout.strip():
        text += "\n[output before the error]\n" + _clip_head(stdout.rstrip(), _ERROR_OUTPUT_BYTES)
    return text


def _clip_head(text: str, limit: int, total: int | None = None) -> str:
    """The first ``limit`` bytes of ``text``, with a marker when anything was cut."""
    data = text.encode()
    total = max(total or 0, len(data))
    if total <= limit:
        return text
    return data[:limit].decode("utf-8", "ignore") + f"\n[output truncated: {total} bytes, the first {limit} shown]"


def _clip_tail(text: str, limit: int) -> str:
    data = text.encode()
    if len(data) <= limit:
        return text
    return f"[... {len(data) - limit} bytes cut]\n" + data[-limit:].decode("utf-8", "ignore")


def _last_line(stderr: str) -> str:
    """The exception line of the last traceback (warnings printed at exit may follow it), else the
    last line."""
    lines = [line.rstrip() for line in stderr.splitlines() if line.strip()]
    starts = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last)")]
    if starts:
        for line in lines[starts[-1] + 1:]:
            if not line.startswith(" "):
                return line[:300]
    return lines[-1].strip()[:300] if lines else ""


def _main_line(stderr: str) -> str:
    found = re.findall(r'File "main\.py", line (\d+)', stderr)
    return f" (main.py line {found[-1]})" if found else ""


def _strip_noise(stderr: str) -> str:
    # The bootstrap's frames are not the policy's code; drop them so tracebacks read as its own.
    return re.sub(r'  File "<string>", line \d+, in [^\n]*\n(?:    [^\n]*\n)*', "", stderr)


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


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


# The child's bootstrap: runs in ``python -I -S -B -c`` before the policy's code, with the config as
# argv[1]. Everything it needs is bound before the code starts, and the audit hook keeps what it
# uses in default arguments (not globals or closures, which the code could reach and change).
_BOOTSTRAP = r'''
import json, os, resource, signal, sys

_cfg = json.loads(sys.argv[1])
_root = os.geteuid() == 0  # before unshare: inside a new user namespace every uid reads as 65534
sys.argv[:] = ["main.py"]
_status = {"network_namespace": False, "user_namespace": False, "seccomp": False, "audit_hook": False,
           "nproc": False}


def _unshare():
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    # CLONE_NEWUSER | CLONE_NEWNET first (works without root); CLONE_NEWNET alone where user
    # namespaces are disabled but the process is privileged
    for flags, user in ((0x10000000 | 0x40000000, True), (0x40000000, False)):
        if libc.unshare(flags) == 0:
            _status["network_namespace"], _status["user_namespace"] = True, user
            return


def _limit(which, soft, hard=None):
    hard = soft if hard is None else hard
    _, current_hard = resource.getrlimit(which)
    if current_hard != resource.RLIM_INFINITY:
        soft, hard = min(soft, current_hard), min(hard, current_hard)
    resource.setrlimit(which, (soft, hard))


def _seccomp():
    if os.uname().machine != "x86_64":
        return
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    ld, jeq, jset, jge, alu_and, ret = 0x20, 0x15, 0x45, 0x35, 0x54, 0x06
    allow, kill, eperm, enosys = 0x7FFF0000, 0x80000000, 0x00050001, 0x00050026

    def arg(i, high=False):
        return 16 + 8 * i + (4 if high else 0)

    me = os.getpid()
    denied = (57, 58, 59, 322,  # fork vfork execve execveat
              41, 42, 49,  # socket connect bind
              101, 310, 311, 200, 434, 424, 438,  # ptrace process_vm_readv/writev tkill pidfd_*
              160,  # setrlimit
              272, 308, 165, 166, 155, 161, 428, 429, 430, 431, 432, 433, 442,  # namespaces, mounts, chroot
              321, 298, 323, 425, 426, 427, 250, 248, 249, 304,  # bpf perf userfaultfd io_uring keys handles
              246, 320, 175, 313, 176, 169, 167, 168, 163,  # kexec modules reboot swap acct
              86, 265, 88, 266)  # link linkat symlink symlinkat
    prog = [(ld, 0, 0, 4), (jeq, 1, 0, 0xC000003E), (ret, 0, 0, kill),  # only the x86-64 syscall ABI
            (ld, 0, 0, 0), (jge, 0, 1, 0x40000000), (ret, 0, 0, kill)]  # no x32 ABI
    for nr in denied:
        prog += [(jeq, 0, 1, nr), (ret, 0, 0, eperm)]
    prog += [(jeq, 0, 1, 435), (ret, 0, 0, enosys)]  # clone3: glibc falls back to clone, whose flags we see
    prog += [(jeq, 0, 4, 56), (ld, 0, 0, arg(0)), (jset, 0, 1, 0x10000),  # clone: CLONE_THREAD only
             (ret, 0, 0, allow), (ret, 0, 0, eperm)]
    prog += [(jeq, 0, 6, 62), (ld, 0, 0, arg(0)), (jeq, 3, 0, me), (jeq, 2, 0, 0),  # kill: itself, its group
             (jeq, 1, 0, (-me) & 0xFFFFFFFF), (ret, 0, 0, eperm), (ret, 0, 0, allow)]
    prog += [(jeq, 0, 4, 234), (ld, 0, 0, arg(0)), (jeq, 0, 1, me),  # tgkill: its own threads
             (ret, 0, 0, allow), (ret, 0, 0, eperm)]
    prog += [(jeq, 0, 6, 302), (ld, 0, 0, arg(2)), (jeq, 0, 3, 0), (ld, 0, 0, arg(2, True)),  # prlimit64: read only
             (jeq, 0, 1, 0), (ret, 0, 0, allow), (ret, 0, 0, eperm)]
    prog += [(jeq, 0, 5, 53), (ld, 0, 0, arg(1)), (alu_and, 0, 0, 0xF), (jeq, 0, 1, 1),  # socketpair: stream
             (ret, 0, 0, allow), (ret, 0, 0, eperm)]
    prog += [(ret, 0, 0, allow)]

    class Filter(ctypes.Structure):
        _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte), ("k", ctypes.c_uint)]

    class Program(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(Filter))]

    filters = (Filter * len(prog))(*[Filter(*i) for i in prog])
    program = Program(len(prog), filters)
    libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong]
    # PR_SET_NO_NEW_PRIVS, then PR_SET_SECCOMP with SECCOMP_MODE_FILTER
    if libc.prctl(38, 1, None, 0, 0) == 0 and libc.prctl(22, 2, ctypes.addressof(program), 0, 0) == 0:
        _status["seccomp"] = True


class SandboxViolation(PermissionError):
    """An operation the sandbox refuses (a PermissionError, so library code that probes and falls
    back, like tempfile's choice of directory, goes on)."""


def _install_guard(sandbox, readable):
    import stat
    denied = frozenset({
        "os.system", "os.fork", "os.forkpty", "os.exec", "os.posix_spawn", "os.spawn", "os.startfile",
        "subprocess.Popen", "pty.spawn", "webbrowser.open", "os.symlink", "os.link", "os.chroot",
        "resource.setrlimit", "resource.prlimit", "sys.settrace", "sys.setprofile", "gc.get_objects",
        "gc.get_referrers", "gc.get_referents", "fcntl.ioctl", "sqlite3.enable_load_extension",
        "sqlite3.load_extension"})
    denied_prefixes = ("socket.", "ctypes.", "syslog.")
    # _posixsubprocess is imported (and disarmed) below; a fresh import would bring fork_exec back
    denied_imports = frozenset({"ctypes", "_ctypes", "_posixsubprocess", "_testcapi", "_testinternalcapi",
                                "_testmultiphase", "_testbuffer", "_xxsubinterpreters", "_xxinterpchannels",
                                "_xxtestfuzz"})
    # event -> (writes?, indices of path arguments, indices of dir_fd arguments)
    path_events = (
        ("os.listdir", False, (0,), ()), ("os.scandir", False, (0,), ()), ("os.getxattr", False, (0,), ()),
        ("os.listxattr", False, (0,), ()), ("os.mkdir", True, (0,), (2,)), ("os.rmdir", True, (0,), (1,)),
        ("os.remove", True, (0,), (1,)), ("os.rename", True, (0, 1), (2, 3)), ("os.chmod", True, (0,), (2,)),
        ("os.chown", True, (0,), (3,)), ("os.utime", True, (0,), (3,)), ("os.truncate", True, (0,), ()),
        ("os.setxattr", True, (0,), ()), ("os.removexattr", True, (0,), ()), ("os.chflags", True, (0,), ()),
        ("os.lchflags", True, (0,), ()), ("shutil.rmtree", True, (0,), (1,)), ("sqlite3.connect", True, (0,), ()),
        ("dbm.open", True, (0,), ()))
    path_event_names = frozenset(e[0] for e in path_events)
    devices = frozenset({"/dev/null", "/dev/urandom", "/dev/random"})
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    # The code objects of the functions below (constants of this function): the ones whose
    # __code__ and __defaults__ must not change.
    code_type = type(_install_guard.__code__)
    ours = tuple(c for c in _install_guard.__code__.co_consts if type(c) is code_type)

    # Every builtin these functions use is a default argument: the policy's code can rebind
    # builtins.any or os.getcwd, but not what was bound here.
    def resolve(path, getcwd=os.getcwd, str_copy=str.__str__, decode=bytes.decode, isinstance_=isinstance):
        # an exact str (a str subclass could override the methods used below)
        if isinstance_(path, bytes):
            path = decode(path, "utf-8", "surrogateescape")
        path = str_copy(path)
        if not path.startswith("/"):
            path = getcwd() + "/" + path
        parts = []
        for part in path.split("/"):
            if part == "..":
                return None  # lexical '..' could leave the allowed tree through a symlink
            if part and part != ".":
                parts.append(part)
        return "/" + "/".join(parts)

    def allowed(path, write, opening=False, resolve=resolve, sandbox=sandbox, readable=readable,
                devices=devices, os_stat=os.stat, is_dir=stat.S_ISDIR, type_=type, int_=int, any_=any):
        if path is None:
            path = "."
        if type_(path) is int_:
            return True  # an open descriptor: it came through a checked open
        try:
            full = resolve(path)
        except Exception:
            return False
        if full is None:
            return False
        if full == sandbox or full.startswith(sandbox + "/"):
            return True
        if full in devices:
            return not write or full == "/dev/null"
        if write or not any_(full == root or full.startswith(root + "/") for root in readable):
            return False
        if opening:
            # A directory outside the sandbox must not become a descriptor: a path relative to it
            # (dir_fd) is not part of the "open" event, so it would escape this check.
            try:
                return not is_dir(os_stat(full).st_mode)
            except OSError:
                return True  # nothing there: the open fails by itself
        return True

    def audit(event, args, denied=denied, denied_prefixes=denied_prefixes, denied_imports=denied_imports,
              path_events=path_events, path_event_names=path_event_names, allowed=allowed, ours=ours,
              error=SandboxViolation, write_flags=write_flags, getpid=os.getpid, str_copy=str.__str__,
              int_value=int.__int__, type_=type, int_=int, len_=len, bool_=bool, any_=any, getattr_=getattr):
        if event == "socket.__new__" and int_value(args[1]) == 1:
            return  # AF_UNIX: asyncio's event loop wakes itself through a socket pair; connect stays refused
        if event in denied or event.startswith(denied_prefixes):
            raise error(f"{event} is not allowed in the sandbox")
        if event == "open":
            path, mode, flags = args[0], args[1], args[2]
            write = bool_(flags & write_flags) if type_(flags) is int_ else True
            if mode is not None and any_(c in str_copy(mode) for c in "wax+"):
                write = True
            if not allowed(path, write, True):
                raise error(f"opening {path!r} is not allowed in the sandbox (only its working directory)")
            return
        if event == "import":
            name = str_copy(args[0])
            if name in denied_imports or name.partition(".")[0] in denied_imports:
                raise error(f"importing {name} is not allowed in the sandbox")
            return
        if event == "object.__setattr__":
            # the stdlib sets these on its own functions (namedtuple, types.coroutine): refused on
            # this hook and its helpers only, whose defaults hold the sandbox's settings
            if len_(args) > 1 and args[1] in ("__code__", "__defaults__", "__kwdefaults__"):
                code = getattr_(args[0], "__code__", None)
                if any_(code is c for c in ours):
                    raise error(f"changing the sandbox's own functions ({args[1]}) is not allowed")
            return
        if event in ("os.kill", "os.killpg"):
            if int_value(args[0]) not in (0, getpid()):
                raise error(f"{event} of another process is not allowed in the sandbox")
            return
        if event in path_event_names:
            if event in ("sqlite3.connect", "dbm.open") and str_copy(args[0]) in (":memory:", ""):
                return
            for name, write, paths, dir_fds in path_events:
                if name != event:
                    continue
                for i in dir_fds:
                    if i < len_(args) and args[i] is not None and args[i] != -1:
                        raise error(f"{event} relative to a directory descriptor is not allowed in the sandbox")
                for i in paths:
                    if i < len_(args) and not allowed(args[i], write):
                        raise error(f"{event} of {args[i]!r} is not allowed in the sandbox "
                                    "(only its working directory)")

    # subprocess (which asyncio imports) needs the module; its fork_exec raises no audit event
    import _posixsubprocess

    def fork_exec(*args, error=SandboxViolation):
        raise error("starting a process is not allowed in the sandbox")

    _posixsubprocess.fork_exec = fork_exec
    sys.addaudithook(audit)


def _main():
    cfg = _cfg
    if cfg["network_namespace"]:
        try:
            _unshare()
        except Exception:
            pass
    _limit(resource.RLIMIT_CPU, cfg["cpu"], cfg["cpu"] + 1)
    _limit(resource.RLIMIT_AS, cfg["memory"])
    _limit(resource.RLIMIT_FSIZE, cfg["fsize"])
    _limit(resource.RLIMIT_CORE, 0)
    if _status["user_namespace"] and not _root:
        # counted per user namespace: this sandbox alone (uid 0 is exempt, hence not for root)
        _limit(resource.RLIMIT_NPROC, cfg["nproc"])
        _status["nproc"] = True
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    if cfg["seccomp"]:
        try:
            _seccomp()
        except Exception:
            pass
    for name in [m for m in sys.modules if m == "ctypes" or m.startswith(("ctypes.", "_ctypes"))]:
        del sys.modules[name]
    sys.stdout.reconfigure(encoding="utf-8", errors="backslashreplace", line_buffering=True)
    sys.stderr.reconfigure(encoding="utf-8", errors="backslashreplace")
    if cfg["audit_hook"]:
        readable = []
        for entry in sys.path:
            if entry and entry.startswith("/"):
                readable += [entry.rstrip("/"), os.path.realpath(entry)]
        _install_guard(cfg["dir"], tuple(readable))
        _status["audit_hook"] = True
    os.write(cfg["status_fd"], json.dumps(_status).encode())
    os.close(cfg["status_fd"])
    with open("main.py", "rb") as f:
        source = f.read()
    code = compile(source, "main.py", "exec")
    exec(code, {"__name__": "__main__", "__file__": "main.py", "__builtins__": __builtins__})


_main()
'''
