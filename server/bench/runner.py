"""Load drivers: closed loop (N virtual users) and open loop (Poisson/gamma arrivals).

A *job* is one unit of work for the chosen workload (one request, or one fork tree) and returns its
records. Closed loop: `concurrency` workers each start the next job as soon as their previous one
ends. Open loop: jobs start at seeded random arrival times whatever is in flight, optionally capped
at `concurrency` in flight (the cap delays the send, not the arrival clock, as in vLLM).
Both stop starting jobs after `num_requests` jobs or `duration` seconds, whichever comes first, and
then wait for the jobs in flight. A fresh httpx.AsyncClient per level keeps levels independent.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import httpx
from tqdm import tqdm

from server.bench.arrivals import inter_arrival_gaps
from server.bench.records import RequestRecord

Job = Callable[[httpx.AsyncClient, int, float], Awaitable[list[RequestRecord]]]


@dataclass
class Level:
    """One load level. `request_rate` None = closed loop; then `concurrency` is the number of users."""

    concurrency: int | None = None
    request_rate: float | None = None
    burstiness: float = 1.0
    num_requests: int | None = None
    duration: float | None = None
    seed: int = 0

    def label(self) -> str:
        if self.request_rate is None:
            return f"concurrency={self.concurrency}"
        cap = f", max-concurrency={self.concurrency}" if self.concurrency else ""
        return f"rate={self.request_rate:g}/s{cap}"

    def to_dict(self) -> dict:
        rate = self.request_rate
        return {
            "mode": "closed" if rate is None else "open",
            "concurrency": self.concurrency,
            "request_rate": None if rate is None else ("inf" if math.isinf(rate) else rate),
            "burstiness": self.burstiness,
            "num_requests": self.num_requests,
            "duration": self.duration,
            "label": self.label(),
        }


@dataclass
class LevelResult:
    level: Level
    records: list[RequestRecord] = field(default_factory=list)
    duration_s: float = 0.0
    skipped: str | None = None


class _Budget:
    """Hands out job indices until the request count or the deadline is reached."""

    def __init__(self, level: Level, t0: float) -> None:
        self._counter = itertools.count()
        self._n = level.num_requests
        self._deadline = t0 + level.duration if level.duration else None

    def next(self) -> int | None:
        if self._deadline is not None and time.perf_counter() >= self._deadline:
            return None
        i = next(self._counter)
        return None if self._n is not None and i >= self._n else i


async def _closed_loop(level: Level, run_one: Callable[[int], Awaitable[None]], budget: _Budget) -> None:
    async def user() -> None:
        while (i := budget.next()) is not None:
            await run_one(i)

    await asyncio.gather(*(user() for _ in range(level.concurrency or 1)))


async def _open_loop(level: Level, run_one: Callable[[int], Awaitable[None]], budget: _Budget) -> None:
    cap = asyncio.Semaphore(level.concurrency) if level.concurrency else None

    async def capped(i: int) -> None:
        if cap is None:
            return await run_one(i)
        async with cap:
            await run_one(i)

    tasks: list[asyncio.Task] = []
    gaps = inter_arrival_gaps(level.request_rate, level.burstiness, level.seed)
    target = time.perf_counter()
    while True:
        target += next(gaps)
        delay = target - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        if (i := budget.next()) is None:
            break
        tasks.append(asyncio.create_task(capped(i)))
    await asyncio.gather(*tasks)


def connection_limit(level: Level, per_job: int) -> int | None:
    """Connections needed so the pool never throttles the load (None = unlimited)."""
    if level.concurrency is None:
        return None
    return level.concurrency * per_job + 4


async def run_level(
    level: Level, job: Job, *, per_job: int = 1, timeout: float = 600.0, progress: bool = True
) -> LevelResult:
    """Run one level to completion and return its records and wall time."""
    limit = connection_limit(level, per_job)
    limits = httpx.Limits(max_connections=limit, max_keepalive_connections=limit)
    result = LevelResult(level=level)
    bar = tqdm(total=level.num_requests, desc=level.label(), unit="req", file=sys.stderr,
               disable=not progress, dynamic_ncols=True)
    errors = 0
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(timeout)) as client:
        t0 = time.perf_counter()

        async def run_one(i: int) -> None:
            nonlocal errors
            recs = await job(client, i, t0)
            result.records.extend(recs)
            errors += sum(not r.ok for r in recs)
            bar.update(1)
            bar.set_postfix(errors=errors, refresh=False)

        driver = _closed_loop if level.request_rate is None else _open_loop
        await driver(level, run_one, _Budget(level, t0))
        result.duration_s = time.perf_counter() - t0
    bar.close()
    result.records.sort(key=lambda r: (r.sent_at, r.index))
    return result
