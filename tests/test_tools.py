"""The calculator and the python sandbox: exact arithmetic and bounded errors from the one, and from
the other a bounded error observation for each thing a policy's code can do wrong (loop forever,
fork, allocate, connect, read the trainer's files, write huge files or output), after which the
next call still works. Small limits keep the whole file to seconds."""

from __future__ import annotations

import asyncio
import os
import socket
import time
from pathlib import Path

import pytest

from megarl.envs.tools.base import ToolResult
from megarl.envs.tools.calculator import Calculator
from megarl.envs.tools.python_sandbox import PythonSandbox
from megarl.envs.tools.registry import TOOL_NAMES, build_tool
from megarl.envs.tools.sandbox.process import SandboxLimits

REPO = Path(__file__).resolve().parents[1]
OUTPUT_BYTES = 1000
MAX_ERROR_CHARS = 1200  # an error line (<= ~400) plus at most 512 bytes of earlier output
GOOD = "print(sum(range(10)))"


def run(coro):
    return asyncio.run(coro)


def calc(expression) -> ToolResult:
    return run(Calculator()({"expression": expression}))


def small_sandbox(**options) -> PythonSandbox:
    limits = dict(cpu_seconds=1, wall_seconds=3, memory_mib=256, output_bytes=OUTPUT_BYTES, file_size_mib=1)
    return PythonSandbox(**{**limits, **options})


@pytest.fixture(scope="module")
def sandbox(starts_processes) -> PythonSandbox:
    """A sandbox runs each program in a process of its own: its tests are integration tests."""
    return small_sandbox()


def execute(tool: PythonSandbox, code) -> tuple[ToolResult, float]:
    started = time.perf_counter()
    result = run(tool({"code": code}))
    return result, time.perf_counter() - started


def assert_error(result: ToolResult, *kinds: str) -> None:
    assert result.error, result.text
    assert result.text.startswith("error: "), result.text
    assert len(result.text) <= MAX_ERROR_CHARS, len(result.text)
    for kind in kinds:
        assert kind in result.text, result.text


# -- calculator ----------------------------------------------------------------------------------


def test_calculator_keeps_integers_exact():
    assert calc("2**100").text == str(2**100)
    assert calc("99999999999999999999 * 99999999999999999999").text == str(99999999999999999999**2)
    assert calc("10**30 / 10").text == "1" + "0" * 29  # an exact quotient stays an integer
    assert calc("-(2**64) + 1").text == str(-(2**64) + 1)
    assert calc(12).text == "12"


@pytest.mark.parametrize("expression, value", [
    ("2 + 3 * 4 ** 2", "50"), ("-2**2", "-4"), ("(2 + 3) * 4", "20"), ("2 ** 3 ** 2", "512"), ("7 / 2", "3.5"),
    ("6 / 3", "2"), ("7 // 2", "3"), ("-7 // 2", "-4"), ("7 % 3", "1"), ("sqrt(16)", "4"), ("abs(-3)", "3"),
    ("round(2.5)", "2"), ("round(3.14159, 2)", "3.14"), ("floor(-1.5)", "-2"), ("ceil(1.2)", "2"),
    ("0.1 + 0.2", "0.30000000000000004"), ("1e16", "1e+16"), ("2.0 * 3", "6"),
])
def test_calculator_precedence_and_formatting(expression, value):
    result = calc(expression)
    assert not result.error and result.text == value, (expression, result.text)


@pytest.mark.parametrize("expression", ["1 / 0", "5 % 0", "1 // 0", "0 ** -1", "1.5 / 0.0"])
def test_calculator_division_by_zero_is_an_error(expression):
    result = calc(expression)
    assert result.error and result.text == "error: division by zero"


@pytest.mark.parametrize("expression, kind", [
    ("__import__('os')", "not arithmetic"), ("__import__('os').system('true')", "not arithmetic"),
    ("().__class__", "not arithmetic"), ("x", "not arithmetic"), ("'a' * 3", "not arithmetic"),
    ("[1]", "not arithmetic"), ("1j", "not arithmetic"), ("True + 1", "not arithmetic"),
    ("lambda: 1", "not arithmetic"), ("abs(1, 2)", "takes 1"), ("round(x=1)", "takes 1 or 2"),
    ("round(1.5, 1.5)", "digits must be an integer"), ("sqrt(-1)", "math domain"), ("1 +", "not an arithmetic"),
    ("(-8) ** (1/3)", "not a real number"), ("1e308 * 10", "not finite"), ("1" * 300, "longer than 200"),
])
def test_calculator_refuses_everything_else(expression, kind):
    result = calc(expression)
    assert result.error and kind in result.text, (expression, result.text)


@pytest.mark.parametrize("expression, kind", [
    ("9 ** 9 ** 9", "exponent 387420489 is larger"), ("2 ** 100000", "exponent 100000 is larger"),
    ("(10 ** 99) ** 64", "more than 100 digits"), ("10 ** 100", "more than 100 digits"),
    ("floor(1e300)", "more than 100 digits"), ("round(5, -10 ** 50)", "digits must be an integer"),
    ("1e200 ** 2", "too large"),
])
def test_calculator_bounds_huge_results_before_computing_them(expression, kind):
    started = time.perf_counter()
    result = calc(expression)
    assert result.error and kind in result.text, (expression, result.text)
    assert time.perf_counter() - started < 0.5


def test_calculator_bad_arguments_are_errors():
    tool = Calculator()
    for arguments in ({}, {"expression": None}, {"expression": True}, {"expression": ["1"]}, None, "1+1"):
        result = run(tool(arguments))
        assert result.error and '"expression" must be a string' in result.text


# -- registry ------------------------------------------------------------------------------------


def test_registry_builds_tools_and_refuses_unknown_names_and_options():
    assert set(TOOL_NAMES) == {"python", "calculator"}
    python = build_tool("python", {"cpu_seconds": 2, "max_concurrency": 2})
    assert isinstance(python, PythonSandbox) and python.limits.cpu_seconds == 2 and python.max_concurrency == 2
    assert isinstance(build_tool("calculator", {}), Calculator)
    with pytest.raises(ValueError, match=r"unknown tool 'shell'; tools: calculator, python"):
        build_tool("shell", {})
    with pytest.raises(ValueError, match=r"tool 'python' has no option 'timeout'; options: cpu_seconds, "):
        build_tool("python", {"timeout": 3})
    with pytest.raises(ValueError, match="cpu_seconds must be a positive integer"):
        build_tool("python", {"cpu_seconds": 0})
    with pytest.raises(ValueError, match="memory_mib must be at least 32"):
        SandboxLimits(memory_mib=8)
    for tool in (python, Calculator()):
        function = tool.spec()["function"]
        assert function["name"] == tool.name and function["parameters"]["required"]


# -- python sandbox: clean runs ------------------------------------------------------------------


def test_sandbox_runs_a_program(sandbox):
    result, seconds = execute(sandbox, GOOD)
    assert result == ToolResult("45", error=False, seconds=result.seconds)
    assert seconds < 3


def test_sandbox_has_the_standard_library(sandbox):
    code = ("import math, json, fractions, collections, dataclasses, re, asyncio, tempfile, pathlib\n"
            "async def f():\n    return math.isqrt(10**20)\n"
            "p = pathlib.Path(tempfile.mkdtemp()) / 'a.txt'\np.write_text('ok')\n"
            "print(asyncio.run(f()), json.dumps([fractions.Fraction(1, 3) * 3 == 1]), p.read_text())")
    result, _ = execute(sandbox, code)
    assert not result.error and result.text == "10000000000 [true] ok", result.text


def test_sandbox_notes_stderr_and_reports_empty_output(sandbox):
    result, _ = execute(sandbox, "import sys\nprint('warned', file=sys.stderr)\nprint(7)")
    assert not result.error and result.text == "7\n[stderr]\nwarned"
    result, _ = execute(sandbox, "x = 1")
    assert not result.error and "no output" in result.text


def test_sandbox_reports_the_exception_and_its_line(sandbox):
    result, _ = execute(sandbox, "print('before')\nx = 1\n1 / 0")
    assert_error(result, "ZeroDivisionError: division by zero (main.py line 3)", "[output before the error]\nbefore")
    result, _ = execute(sandbox, "def f(:\n    pass")
    assert_error(result, "SyntaxError", "main.py line 1")
    result, _ = execute(sandbox, "import sys\nsys.exit(3)")
    assert_error(result, "exited with code 3")


def test_sandbox_refuses_bad_arguments(sandbox):
    for arguments in ({}, {"code": 3}, None):
        result = run(sandbox(arguments))
        assert result.error and '"code" must be a string' in result.text
    result = run(small_sandbox(code_bytes=100)({"code": "#" * 101}))
    assert result.error and "longer than 100 bytes" in result.text


# -- python sandbox: each bad program is a bounded error, and the next call works -----------------


@pytest.fixture(scope="module")
def listener():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.setblocking(False)
    yield server
    server.close()


BAD_PROGRAMS = {
    "cpu loop": ("while True:\n    pass", ["time limit (1 s CPU) exceeded"]),
    "cpu loop ignoring SIGXCPU": ("import signal\nsignal.signal(signal.SIGXCPU, signal.SIG_IGN)\nwhile True:\n"
                                  "    pass", ["time limit (1 s CPU) exceeded"]),
    "sleep": ("import time\ntime.sleep(60)", ["time limit (3 s wall clock) exceeded"]),
    "fork bomb": ("import os\nwhile True:\n    os.fork()", ["forbidden operation", "os.fork", "main.py line 3"]),
    "subprocess": ("import subprocess\nsubprocess.run(['ls', '/'])", ["forbidden operation", "subprocess.Popen"]),
    "os.system": ("import os\nos.system('echo hi > /tmp/x')", ["forbidden operation", "os.system"]),
    "huge allocation": ("x = bytearray(10**10)", ["memory limit (256 MiB) exceeded", "main.py line 1"]),
    "growing list": ("x = []\nwhile True:\n    x.append(bytearray(10**6))", ["memory limit (256 MiB) exceeded"]),
    "internet": ("import socket\nsocket.create_connection(('1.1.1.1', 80), timeout=2)",
                 ["forbidden operation", "socket."]),
    "dns": ("import socket\nsocket.getaddrinfo('example.com', 80)", ["forbidden operation", "socket.getaddrinfo"]),
    "trainer's config": (f"print(open({str(REPO / 'pyproject.toml')!r}).read())",
                         ["forbidden operation", "opening", "pyproject.toml"]),
    "this test file": (f"print(open({str(Path(__file__).resolve())!r}).read())",
                       ["forbidden operation", "test_tools.py"]),
    "relative escape": ("print(open('../../../../etc/passwd').read())", ["forbidden operation"]),
    "listing /": ("import os\nprint(os.listdir('/'))", ["forbidden operation", "os.listdir"]),
    "write outside": ("open('/tmp/megarl-sandbox-escape', 'w').write('x')", ["forbidden operation", "opening"]),
    "huge file": ("open('big', 'wb').write(b'x' * 2 * 2**20)", ["file size limit (1 MiB) exceeded"]),
    "file in a loop": ("with open('big', 'wb') as f:\n    while True:\n        f.write(b'x' * 65536)",
                       ["file size limit (1 MiB) exceeded"]),
    "output flood": ("while True:\n    print('y' * 1000)", ["output limit exceeded"]),
    "ctypes": ("import ctypes\nctypes.CDLL(None).system(b'true')", ["forbidden operation", "ctypes"]),
    "raising limits": ("import resource\nresource.setrlimit(resource.RLIMIT_CPU, (100, 100))",
                       ["forbidden operation", "resource.setrlimit"]),
    "kill the trainer": ("import os\nos.kill(os.getppid(), 9)", ["forbidden operation", "os.kill"]),
}


@pytest.mark.parametrize("name", list(BAD_PROGRAMS))
def test_sandbox_bad_program_is_a_bounded_error_and_the_run_continues(sandbox, name):
    code, kinds = BAD_PROGRAMS[name]
    result, seconds = execute(sandbox, code)
    assert_error(result, *kinds)
    assert seconds < 3 + 2, seconds  # the wall limit, plus start-up and reaping
    after, _ = execute(sandbox, GOOD)
    assert not after.error and after.text == "45"
    assert not os.path.exists("/tmp/megarl-sandbox-escape")


def test_sandbox_cannot_reach_a_local_listener(sandbox, listener):
    port = listener.getsockname()[1]
    result, _ = execute(sandbox, f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)")
    assert_error(result, "forbidden operation", "socket.")
    with pytest.raises(BlockingIOError):
        listener.accept()  # nothing arrived
    assert not execute(sandbox, GOOD)[0].error


def test_sandbox_environment_is_empty(sandbox, monkeypatch):
    monkeypatch.setenv("MEGARL_SANDBOX_SECRET", "hunter2")
    result, _ = execute(sandbox, "import os, sys\nprint(dict(os.environ))\nprint(sys.path)")
    assert not result.error, result.text
    for leaked in ("MEGARL_SANDBOX_SECRET", "hunter2", "HOME", "PATH", "PYTHONPATH", "VIRTUAL_ENV", str(REPO)):
        assert leaked not in result.text, (leaked, result.text)


def test_sandbox_truncates_output_to_the_limit(sandbox):
    result, _ = execute(sandbox, "print('x' * 100000)")
    assert not result.error
    assert result.text.startswith("x" * OUTPUT_BYTES)
    assert "[output truncated: 100001 bytes, the first 1000 shown]" in result.text
    assert len(result.text) <= OUTPUT_BYTES + 100


def test_sandbox_deletes_its_directory(sandbox):
    result, _ = execute(sandbox, "import os\nopen('f', 'w').write('x')\nos.mkdir('d')\nos.chmod('d', 0)\n"
                                 "print(os.getcwd())")
    assert not result.error and "megarl-python-" in result.text, result.text
    assert not os.path.exists(result.text)


def test_sandbox_cancelled_call_stops_the_program_and_the_next_call_works(sandbox):
    async def cancel_one() -> float:
        started = time.perf_counter()
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(sandbox({"code": "import time\ntime.sleep(60)"}), 0.5)
        return time.perf_counter() - started

    assert run(cancel_one()) < 2
    assert execute(sandbox, GOOD)[0].text == "45"


def test_sandbox_many_concurrent_calls_finish(starts_processes):
    tool = small_sandbox(max_concurrency=3)
    programs = [f"print({i} * {i})" for i in range(10)] + ["while True:\n    pass", "import os\nos.fork()"]

    async def all_at_once() -> list[ToolResult]:
        return await asyncio.gather(*(tool({"code": code}) for code in programs))

    started = time.perf_counter()
    results = run(all_at_once())
    assert [r.text for r in results[:10]] == [str(i * i) for i in range(10)]
    assert_error(results[10], "time limit (1 s CPU)")
    assert_error(results[11], "forbidden operation")
    assert time.perf_counter() - started < 10


# -- python sandbox: each layer on its own, where this machine has it -----------------------------


def layered(**layers) -> PythonSandbox:
    tool = small_sandbox()
    tool._layers = {"network_namespace": False, "seccomp": False, "audit_hook": False, **layers}
    return tool


def test_without_layers_the_same_programs_succeed(listener, starts_processes):
    """The control for the tests below: they fail because of the layer, not by accident (only a
    harmless connect and a no-op setrlimit run unguarded)."""
    tool = layered()
    port = listener.getsockname()[1]
    code = (f"import socket, resource\nsocket.create_connection(('127.0.0.1', {port}), timeout=2).close()\n"
            "resource.setrlimit(resource.RLIMIT_CPU, resource.getrlimit(resource.RLIMIT_CPU))\n"
            "print('connected')")
    result, _ = execute(tool, code)
    assert not result.error and result.text == "connected", result.text
    listener.setblocking(True)
    listener.settimeout(2)
    listener.accept()[0].close()
    listener.setblocking(False)
    assert tool.isolation == {"network_namespace": False, "user_namespace": False, "seccomp": False,
                              "audit_hook": False, "nproc": False}


def test_audit_hook_alone_refuses_forks_sockets_and_files(listener, starts_processes):
    tool = layered(audit_hook=True)
    port = listener.getsockname()[1]
    assert_error(execute(tool, "import os\nos.fork()")[0], "forbidden operation", "os.fork")
    assert_error(execute(tool, f"import socket\nsocket.create_connection(('127.0.0.1', {port}))")[0],
                 "forbidden operation")
    assert_error(execute(tool, "open('/etc/hostname').read()")[0], "forbidden operation")
    assert tool.isolation["audit_hook"] and not tool.isolation["seccomp"]


def test_seccomp_alone_refuses_forks_and_sockets(starts_processes):
    tool = layered(seccomp=True)
    if not execute(tool, GOOD)[0].text == "45" or not tool.isolation.get("seccomp"):
        pytest.skip("seccomp filter unavailable here (not x86-64 Linux, or refused by the kernel)")
    for code in ("import os\nos.fork()", "import socket\nsocket.socket()",
                 "import subprocess\nsubprocess.run(['/bin/true'])", "import os\nos.execv('/bin/true', ['true'])"):
        assert_error(execute(tool, code)[0], "PermissionError: [Errno 1] Operation not permitted")
    # setting a limit to its current value is refused too (a root trainer's child could otherwise raise them);
    # CPython words every EPERM from setrlimit this way
    same = "import resource\nresource.setrlimit(resource.RLIMIT_CPU, resource.getrlimit(resource.RLIMIT_CPU))"
    assert_error(execute(tool, same)[0], "ValueError: not allowed to raise maximum limit")
    threads = "import threading\nt = threading.Thread(target=print, args=('thread',))\nt.start()\nt.join()"
    assert execute(tool, threads)[0].text == "thread"  # threads are still allowed


def test_network_namespace_alone_has_no_network(listener, starts_processes):
    tool = layered(network_namespace=True)
    if not execute(tool, GOOD)[0].text == "45" or not tool.isolation.get("network_namespace"):
        pytest.skip("no network namespace here (unshare refused)")
    port = listener.getsockname()[1]
    result, _ = execute(tool, f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)")
    assert_error(result, "Network is unreachable")
    with pytest.raises(BlockingIOError):
        listener.accept()
