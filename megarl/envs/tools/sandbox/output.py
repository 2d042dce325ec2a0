"""What the policy reads back from one run of the ``python`` tool: the program's output, clipped to
the limit, or a short error naming the limit it hit or the operation the sandbox refused."""

from __future__ import annotations

import re
import signal

from megarl.envs.tools.sandbox.process import Run, SandboxLimits

_ERROR_OUTPUT_BYTES = 512  # what an error text shows of the output printed before the error


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
