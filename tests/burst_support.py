"""A burst of huge and hostile requests against a real `cellserve serve`, and the server's RSS around it.

The burst (`Burst.run`) is what a hostile-input probe sends, for a bounded time: prompts up to the context,
bodies near `--max-body-bytes` (refused before tokenization), `n` x prompts bombs up to `--max-choices`,
prompt-logprob requests over long prompts, streams dropped after their first chunk, and malformed bodies.
Every answer must be a 200 or a clear 4xx (a 429 when the queue is full); a 5xx fails the run. `RssWatch`
samples the server's VmRSS from /proc while it runs, so the peak is the burst's, not a guess.

`python tests/burst_support.py [--seconds 20] [--trim-idle 0|1.5]` runs one burst against the bundled model and
prints RSS after warm-up, the peak, and RSS after each second of idleness (how docs/performance.md measured it).
"""

import asyncio
import contextlib
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
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} in /proc/{pid}/status")


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
                self.peak_mb = max(self.peak_mb, proc_kb(self.pid, "VmRSS") / 1024)
            self._stop.wait(self.every)


class Burst:
    """Hostile traffic from `clients` concurrent clients for `seconds`; `statuses` counts the answers and
    `bad` keeps every answer the contract forbids (a 5xx)."""

    def __init__(self, url: str, *, context: int, max_body_bytes: int, max_choices: int, seed: int = 0):
        self.url, self.context = url, context
        self.max_body_bytes, self.max_choices = max_body_bytes, max_choices
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

    async def huge_body(self, c) -> None:  # near the body limit: refused before tokenization
        n = self.max_body_bytes - 1024
        await self._post(c, "body", "/v1/completions", content=b'{"prompt": "' + b"a " * (n // 2) + b'"}',
                         headers={"content-type": "application/json"})

    async def n_bomb(self, c) -> None:  # prompts x n up to --max-choices, short prompts
        n = self.rng.choice([8, 16, 32])
        prompts = [self.text(3) for _ in range(self.max_choices // 2 // n)]
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
            async with httpx.AsyncClient(timeout=120) as c:
                while time.monotonic() < until and left[0] > 0:
                    left[0] -= 1
                    await kinds[(i + self.rng.randrange(len(kinds))) % len(kinds)](c)

        await asyncio.gather(*(client(i) for i in range(clients)))


def main() -> None:  # measuring by hand: see the module docstring
    import argparse
    import os
    import sys
    import tempfile

    sys.path.insert(0, str(Path(__file__).parent))
    from soak_support import ROOT, ServerProcess

    p = argparse.ArgumentParser()
    p.add_argument("--seconds", type=float, default=20)
    p.add_argument("--trim-idle", default=None, help="CELLSERVE_MALLOC_TRIM_IDLE_S for the server")
    p.add_argument("--idle", type=int, default=10)
    p.add_argument("--warm-seconds", type=float, default=3)
    p.add_argument("--bursts", type=int, default=1)
    a = p.parse_args()
    if a.trim_idle is not None:
        os.environ["CELLSERVE_MALLOC_TRIM_IDLE_S"] = a.trim_idle
    srv = ServerProcess(str(ROOT / "engine/loader/default/model"), Path(tempfile.mkdtemp()) / "server.log",
                        n_cells=8192, max_queue=1024, max_num_seqs=256, max_body_bytes=8 << 20)
    try:
        srv.start(timeout=900)
        burst = Burst(srv.url, context=500, max_body_bytes=8 << 20, max_choices=1024)
        asyncio.run(burst.run(a.warm_seconds, clients=2))  # warm-up: every kind once or more
        time.sleep(3)
        warm = srv.rss_mb()
        print(f"warm: anon {proc_kb(srv.proc.pid, 'RssAnon') >> 10}, file {proc_kb(srv.proc.pid, 'RssFile') >> 10}")
        for i in range(a.bursts - 1):
            asyncio.run(burst.run(a.seconds))
            time.sleep(4)
            print(f"burst {i + 1}: then {srv.rss_mb():.0f} MiB")
        with RssWatch(srv.proc.pid) as watch:
            asyncio.run(burst.run(a.seconds))
        print({k: v for k, v in burst.samples.items() if k[1] != 200})
        print(f"warm {warm:.0f} MiB, peak {watch.peak_mb:.0f}, after the burst {srv.rss_mb():.0f}; "
              f"statuses {sorted(burst.statuses.items())}; bad {burst.bad[:3]}")
        for s in range(a.idle):
            time.sleep(1)
            pid = srv.proc.pid
            print(f"idle {s + 1:2d} s: {srv.rss_mb():.0f} MiB (anon {proc_kb(pid, 'RssAnon') >> 10}, "
                  f"file {proc_kb(pid, 'RssFile') >> 10})")
        freed = httpx.delete(srv.url + "/v1/cache/prefixes").json()["freed_cells"]
        httpx.post(srv.url + "/v1/completions", json={"prompt": "a", "max_tokens": 1})  # busy, so idle trims again
        time.sleep(3)
        print(f"cached prefixes cleared ({freed} cells), trimmed: {srv.rss_mb():.0f} MiB "
              f"(anon {proc_kb(srv.proc.pid, 'RssAnon') >> 10})")
        print([line for line in httpx.get(srv.url + "/metrics").text.splitlines() if "memory_bytes{" in line])
    finally:
        srv.kill()


if __name__ == "__main__":
    main()
