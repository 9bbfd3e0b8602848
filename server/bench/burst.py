"""A burst of huge and hostile requests against any OpenAI-compatible server, and the server's RSS around it.

    python -m server.bench.burst --url http://127.0.0.1:8000 --pid PID [--requests 64] [--idle 10]

The burst (`Burst.run`) is what a hostile-input probe sends, for a bounded time or number of requests: prompts
up to the context, bodies near `--max-body-bytes` (cellserve refuses them before tokenization), `n` x prompts
bombs up to `--max-choices`, prompt-logprob requests over long prompts, streams dropped after their first chunk,
and malformed bodies. `statuses` counts the answers by (kind, status) and `bad` keeps every 5xx. `RssWatch`
samples a process's VmRSS from /proc while it runs, so the peak is the burst's, not a guess.

The command runs a warm-up burst, waits for `--idle` seconds, reads RSS, runs the measured burst under an
`RssWatch`, then prints RSS after each second of `--idle` and one JSON line (warm, peak, after, statuses). It
reads only HTTP and /proc, so cellserve and llama.cpp's `llama-server` get the same bytes: `--expand-n` sends an
`n` x prompts bomb as n copies of each prompt with n=1 (llama-server answers one choice a prompt), the same
number of sequences either way. tests/server/test_memory_burst.py runs the same `Burst` against the bundled model.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Self

import httpx

WORDS = ["thou", "art", "the", "sun", "and", "moon", "that", "rise", "upon", "the", "hill", "of", "verona", "where",
         "the", "night", "is", "young", "and", "every", "word", "a", "star"]


def proc_kb(pid: int, field: str) -> int:
    """A `kB` field of /proc/PID/status (VmRSS, VmHWM, RssAnon, ...)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} in /proc/{pid}/status")


def rss_mb(pid: int) -> float:
    return proc_kb(pid, "VmRSS") / 1024


class RssWatch:
    """Samples a process's VmRSS every `every` seconds on a thread; `peak_mb` is the largest sample."""

    def __init__(self, pid: int, every: float = 0.05):
        self.pid, self.every = pid, every
        self.peak_mb = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(OSError, AssertionError):
                self.peak_mb = max(self.peak_mb, rss_mb(self.pid))
            self._stop.wait(self.every)


class Burst:
    """Hostile traffic from `clients` concurrent clients; `statuses` counts the answers and `bad` keeps every
    answer the contract forbids (a 5xx). `context` is the longest prompt in words; the text is seeded."""

    def __init__(self, url: str, *, context: int, max_body_bytes: int, max_choices: int, seed: int = 0,
                 expand_n: bool = False, timeout: float = 600):
        self.url, self.context = url, context
        self.max_body_bytes, self.max_choices = max_body_bytes, max_choices
        self.expand_n, self.timeout = expand_n, timeout
        self.rng = random.Random(seed)
        self.statuses: Counter = Counter()
        self.bad: list[str] = []
        self.samples: dict[tuple[str, int], str] = {}  # one answer per (kind, status), for a failure's message

    def text(self, n_words: int) -> str:
        return " ".join(self.rng.choice(WORDS) for _ in range(n_words))

    def record(self, kind: str, status: int, body: str = "") -> None:
        self.statuses[(kind, status)] += 1
        self.samples.setdefault((kind, status), body[:300])
        if status >= 500:
            self.bad.append(f"{kind}: {status} {body[:200]}")

    async def _post(self, c: httpx.AsyncClient, kind: str, path: str, **kw) -> None:
        r = await c.post(self.url + path, **kw)
        self.record(kind, r.status_code, r.text)

    async def huge_prompt(self, c) -> None:  # up to the context: a full prefill, a few tokens
        await self._post(c, "huge", "/v1/completions", json={
            "prompt": self.text(self.rng.randint(self.context // 2, self.context)), "max_tokens": 4})

    async def huge_body(self, c) -> None:  # near the body limit
        n = self.max_body_bytes - 1024
        await self._post(c, "body", "/v1/completions", content=b'{"prompt": "' + b"a " * (n // 2) + b'"}',
                         headers={"content-type": "application/json"})

    async def n_bomb(self, c) -> None:  # prompts x n up to --max-choices, short prompts
        n = self.rng.choice([8, 16, 32])
        prompts = [self.text(3) for _ in range(max(1, self.max_choices // 2 // n))]
        if self.expand_n:
            prompts, n = [p for p in prompts for _ in range(n)], 1
        await self._post(c, "nbomb", "/v1/completions", json={
            "prompt": prompts, "n": n, "max_tokens": 8, "temperature": 1.0, "logprobs": 5})

    async def prompt_logprobs(self, c) -> None:  # every prompt token scored, top 20
        await self._post(c, "plp", "/v1/completions", json={
            "prompt": self.text(self.context // 3), "max_tokens": 1, "prompt_logprobs": 20})

    async def dropped_stream(self, c) -> None:  # the client leaves after its first chunk
        async with c.stream("POST", self.url + "/v1/completions", json={
                "prompt": self.text(self.context // 2), "max_tokens": 200, "stream": True}) as r:
            self.record("drop", r.status_code)
            async for _ in r.aiter_lines():
                break

    async def malformed(self, c) -> None:
        body = self.rng.choice([b"{", b'{"prompt": 1e999999}', b'{"prompt": "x", "n": -1}', b"[]" * 1000])
        await self._post(c, "malformed", "/v1/completions", content=body,
                         headers={"content-type": "application/json"})

    async def run(self, seconds: float, clients: int = 8, requests: int | None = None) -> None:
        """Send for `seconds`, or until `requests` were sent (the same load on a fast and a slow machine)."""
        kinds = [self.huge_prompt, self.huge_body, self.n_bomb, self.prompt_logprobs, self.dropped_stream,
                 self.malformed]
        until = time.monotonic() + seconds
        left = [requests if requests is not None else 1 << 62]

        async def client(i: int) -> None:
            async with httpx.AsyncClient(timeout=self.timeout) as c:
                while time.monotonic() < until and left[0] > 0:
                    left[0] -= 1
                    await kinds[(i + self.rng.randrange(len(kinds))) % len(kinds)](c)

        await asyncio.gather(*(client(i) for i in range(clients)))


def measure(a: argparse.Namespace) -> dict:
    """Warm-up burst, idle, the measured burst under an RssWatch, idle; RSS at each point (MiB)."""
    burst = Burst(a.url, context=a.context, max_body_bytes=a.max_body_bytes, max_choices=a.max_choices,
                  expand_n=a.expand_n)
    start = rss_mb(a.pid)
    asyncio.run(burst.run(a.seconds, clients=a.clients, requests=a.requests))
    time.sleep(a.idle)
    warm = rss_mb(a.pid)
    burst.statuses.clear()
    with RssWatch(a.pid) as watch:
        asyncio.run(burst.run(a.seconds, clients=a.clients, requests=a.requests))
    idle = []
    for s in range(a.idle):
        time.sleep(1)
        idle.append(round(rss_mb(a.pid)))
        print(f"idle {s + 1:2d} s: {idle[-1]} MiB (anon {proc_kb(a.pid, 'RssAnon') >> 10})", flush=True)
    return {"start_mib": round(start), "warm_mib": round(warm), "peak_mib": round(watch.peak_mb),
            "after_mib": idle[-1] if idle else round(rss_mb(a.pid)), "idle_mib": idle,
            "statuses": {f"{k} {s}": v for (k, s), v in sorted(burst.statuses.items())}, "bad": burst.bad[:5]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m server.bench.burst", description=__doc__.split("\n\n")[0])
    p.add_argument("--url", required=True, help="the server's base URL")
    p.add_argument("--pid", type=int, required=True, help="the server's process id (RSS is read from /proc)")
    p.add_argument("--requests", type=int, default=64, help="requests in a burst (the warm-up and the measured)")
    p.add_argument("--seconds", type=float, default=600, help="a burst stops after this long, whatever is left")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--context", type=int, default=500, help="the longest prompt, in words")
    p.add_argument("--max-body-bytes", type=int, default=8 << 20, help="the near-limit body's size")
    p.add_argument("--max-choices", type=int, default=1024, help="an n-bomb's prompts x n (half of this)")
    p.add_argument("--expand-n", action="store_true", help="send n-bombs as n copies of each prompt with n=1")
    p.add_argument("--idle", type=int, default=10, help="seconds idle after each burst")
    p.add_argument("--out", help="also write the JSON line to this file")
    a = p.parse_args(argv)
    result = measure(a)
    line = json.dumps(result)
    print(line)
    if a.out:
        Path(a.out).write_text(line + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
