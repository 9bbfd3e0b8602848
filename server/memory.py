"""Handing freed heap back to the OS when the server goes idle (issue #30).

glibc keeps freed memory in its arenas; after a burst of variable-size work (step tensors, JSON bodies,
token lists) resident memory can stay at the burst's high-water mark although nothing holds it.
`malloc_trim(0)` returns the free pages of every arena. `IdleTrim` calls it once each time the engine
has had nothing running or waiting for `idle_s` seconds (so it never competes with a tick), from a
daemon thread that polls the engine's counters once a second. Elsewhere than glibc it does nothing.

Opt-in: `CELLSERVE_MALLOC_TRIM_IDLE_S=5` (seconds of idleness before a trim; unset or 0: off). What it
does to RSS is measured in docs/performance.md ("Memory over time").
"""

import ctypes
import ctypes.util
import logging
import os
import threading
import time
from collections.abc import Callable

log = logging.getLogger("cellserve")
ENV = "CELLSERVE_MALLOC_TRIM_IDLE_S"


def _malloc_trim() -> Callable[[int], int] | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


class IdleTrim:
    """`IdleTrim(stats, idle_s).start()`: `stats()` returns the engine's stats (or None while loading)."""

    def __init__(self, stats: Callable[[], object], idle_s: float):
        self.stats, self.idle_s = stats, idle_s
        self.trims = 0
        self._trim = _malloc_trim()

    def start(self) -> "IdleTrim":
        if self._trim is not None:
            threading.Thread(target=self._run, name="cellserve-idle-trim", daemon=True).start()
        return self

    def _run(self) -> None:
        last_steps, idle_since, trimmed = None, time.monotonic(), True
        while True:
            time.sleep(1.0)
            s = self.stats()
            if s is None:
                continue
            busy = s.running or s.waiting or s.steps != last_steps
            last_steps = s.steps
            if busy:
                idle_since, trimmed = time.monotonic(), False
            elif not trimmed and time.monotonic() - idle_since >= self.idle_s:
                self._trim(0)
                self.trims, trimmed = self.trims + 1, True


def idle_trim_from_env(stats: Callable[[], object]) -> IdleTrim | None:
    """Start an `IdleTrim` when CELLSERVE_MALLOC_TRIM_IDLE_S is set to a positive number of seconds."""
    try:
        idle_s = float(os.environ.get(ENV, "0") or 0)
    except ValueError:
        log.warning("%s=%r is not a number of seconds; not trimming", ENV, os.environ.get(ENV))
        return None
    return IdleTrim(stats, idle_s).start() if idle_s > 0 else None
