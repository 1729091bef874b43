"""Measured cost of a call: best-of-n wall time and the peak resident-memory increase (Linux).

Used to compare hypergradient methods (hypergradients notebook) and, later, HVP-only against explicit-Hessian
updates (DSBO). Memory is measured, not computed: the kernel's high-water mark of resident memory (VmHWM) is
reset through /proc/self/clear_refs, the call runs, and the increase over the resident size before it is
returned. Freed heap is first handed back (malloc_trim) so that the baseline is the live memory."""
from __future__ import annotations

import ctypes
import re
import time
from pathlib import Path
from typing import Callable

_STATUS = Path("/proc/self/status")


def _status_mb(key: str) -> float:
    match = re.search(rf"^{key}:\s+(\d+) kB", _STATUS.read_text(), re.MULTILINE)
    if match is None:
        raise RuntimeError(f"/proc/self/status has no {key} line")
    return int(match.group(1)) / 1024


def peak_rss_increase_mb(fn: Callable[[], object]) -> float:
    """MB by which the process's peak resident memory rises above its current size while `fn()` runs."""
    if not _STATUS.exists():
        raise RuntimeError("peak_rss_increase_mb needs Linux (/proc/self/status and /proc/self/clear_refs)")
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    Path("/proc/self/clear_refs").write_text("5")  # "5" resets the peak-RSS high-water mark
    base = _status_mb("VmRSS")
    fn()
    return max(_status_mb("VmHWM") - base, 0.0)


def best_time(fn: Callable[[], object], repeats: int = 3) -> float:
    """The smallest of `repeats` wall-clock times of `fn()` in seconds (the least disturbed run)."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)
