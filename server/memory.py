"""Handing freed heap back to the OS once the engine goes idle (issue #47, item 3).

glibc keeps freed memory in its arenas (the event loop's, each worker thread's, the engine thread's); after a
burst of variable-size work (request bodies, JSON, token lists, step tensors) the process stays at the burst's
high-water mark although nothing holds it. `malloc_trim(0)` returns the free pages of every arena. `IdleTrim`
calls it once each time the engine has had nothing running or waiting, and taken no step, for `idle_s`
seconds (so it never competes with a tick), from a daemon thread that polls the engine's counters every
`poll_s`. It counts the trims and the RSS each gave back (`/metrics`: `cellserve:malloc_trims_total`,
`cellserve:malloc_trim_released_bytes_total`). Elsewhere than glibc it does nothing.

On by default, 1.5 s after the last step (`CELLSERVE_MALLOC_TRIM_IDLE_S` sets the seconds; 0 turns it off). After
a burst against the bundled model it gave back 60-85 MiB (docs/performance.md, "A burst, and what comes back").
"""

import gc
import logging
import os
import threading
import time
from collections.abc import Callable

from engine.api.memory import malloc_trim, process_rss

log = logging.getLogger("cellserve")
ENV = "CELLSERVE_MALLOC_TRIM_IDLE_S"
DEFAULT_IDLE_S = 1.5


class IdleTrim:
    """`IdleTrim(stats, idle_s).start()`: `stats()` returns the engine's stats (or None while loading).
    Guarantees: at most one trim per idle period, never while a request runs or waits."""

    def __init__(self, stats: Callable[[], object], idle_s: float, poll_s: float = 0.25):
        self.stats, self.idle_s, self.poll_s = stats, idle_s, poll_s
        self.trims = 0
        self.released_bytes = 0  # RSS the trims gave back, summed

    def start(self) -> "IdleTrim":
        threading.Thread(target=self._run, name="cellserve-idle-trim", daemon=True).start()
        return self

    def _run(self) -> None:
        last_steps, idle_since, trimmed = None, time.monotonic(), True
        while True:
            time.sleep(self.poll_s)
            s = self.stats()
            if s is None:
                continue
            busy = s.running or s.waiting or s.steps != last_steps
            last_steps = s.steps
            if busy:
                idle_since, trimmed = time.monotonic(), False
            elif not trimmed and time.monotonic() - idle_since >= self.idle_s:
                self.trim()
                trimmed = True

    def trim(self) -> bool:
        """Collect Python's cyclic garbage, then trim; False where the C library cannot."""
        before, _ = process_rss()
        gc.collect()  # a burst's reference cycles (tasks, exceptions) keep whole pymalloc arenas alive until then
        if not malloc_trim():
            return False
        after, _ = process_rss()
        self.trims += 1
        self.released_bytes += max(0, before - after)
        return True


def idle_trim_from_env(stats: Callable[[], object]) -> IdleTrim | None:
    """Start an `IdleTrim` after CELLSERVE_MALLOC_TRIM_IDLE_S seconds of idleness (default 1.5; 0: off)."""
    raw = os.environ.get(ENV)
    try:
        idle_s = DEFAULT_IDLE_S if raw is None or raw == "" else float(raw)
    except ValueError:
        log.warning("%s=%r is not a number of seconds; trimming after %g s", ENV, raw, DEFAULT_IDLE_S)
        idle_s = DEFAULT_IDLE_S
    return IdleTrim(stats, idle_s).start() if idle_s > 0 else None
