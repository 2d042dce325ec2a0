"""Process memory as the kernel counts it: current and peak resident set size."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import resource
from pathlib import Path


def _status_kib(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def current_rss() -> int:
    kib = _status_kib("VmRSS")
    return kib * 1024 if kib is not None else peak_rss()


def peak_rss() -> int:
    kib = _status_kib("VmHWM")
    return kib * 1024 if kib is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def reset_peak_rss() -> bool:
    """Restarts the peak (high-water mark) from the current RSS; False where unsupported."""
    try:
        Path("/proc/self/clear_refs").write_text("5")  # Linux >= 4.0: reset VmHWM
        return True
    except OSError:
        return False


@functools.cache
def _malloc_trim():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc.malloc_trim
    except (OSError, AttributeError):  # not glibc: its allocator returns memory its own way
        return None


def release_free_memory() -> bool:
    """Hands the allocator's free pages back to the kernel (glibc ``malloc_trim``); False where unsupported.

    glibc keeps freed blocks of its heaps resident, and a block freed by one thread's arena
    cannot serve another thread's allocation: a tensor freed on one thread while an equal one
    is allocated on another counts twice in the resident set until the free pages are trimmed.
    """
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
