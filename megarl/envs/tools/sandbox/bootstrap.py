"""The code the sandboxed child runs before the policy's program: a network namespace, rlimits, a
seccomp filter and an audit hook, in that order, then a one-line report of the layers it set up,
written to the status pipe (``megarl.envs.tools.python_sandbox`` explains each layer and what it
does not protect against).

It is source text run by ``python -I -S -B -c BOOTSTRAP CONFIG_JSON``, not a module: the child's
isolated interpreter has no site-packages, so it cannot import megarl.
"""

# Everything the bootstrap needs is bound before the policy's code starts, and the audit hook keeps
# what it uses in default arguments (not globals or closures, which the code could reach and change).
BOOTSTRAP = r'''
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
