"""One HTTP generation as engine requests: start, merge their outputs, cancel what is left.

A completion with several prompts becomes one engine request per prompt (ids `<id>-0`, `<id>-1`,
...; a single prompt keeps `<id>` itself); `n` choices per prompt are the engine's business (it
prefills once and forks). `GenerationRun` guarantees:
- `start()` either admits every engine request or raises the engine's typed error (QueueFull,
  PromptTooLong, SequenceBusy, ...) after cancelling the ones it had submitted, so a refused HTTP
  request leaves nothing behind.
- `events()` yields `(prompt_index, RequestOutput)` in arrival order, per-request order preserved.
- `cancel()` cancels only requests that have not finished (the consumer still reads their final
  `cancelled` output); `close()` is what every route calls in a `finally`: it cancels what is left
  and counts it, so a dropped client or an exception frees the request's cells at the next tick.
  A submit the caller stopped waiting for (its client left) still completes, and what it admitted is
  cancelled then: nothing a run submitted outlives it unobserved.
- `ended()` returns once every engine request the run submitted has ended (its final output left the
  engine), even when nobody reads the outputs any more: after it, the sequence the run generated
  into is idle, so a verb on it (truncate) cannot find it busy with a cancel still queued.

How a route waits on a run (and notices a client that leaves) is `server.generation.driver`.
"""

import asyncio
import functools
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from engine.api.outputs import RequestOutput
from server.metrics import RequestObserver, ServerMetrics

if TYPE_CHECKING:  # types only: the server does not import the engine (torch) at run time
    from engine.api.client import EngineClient
    from engine.api.sampling_params import SamplingParams


_END = object()


class GenerationRun:
    def __init__(self, engine: "EngineClient", request_id: str, prompts: list[list[int]], params: "SamplingParams", *,
                 seq_id: str | None = None, metrics: ServerMetrics | None = None):
        self.engine = engine
        self.request_id = request_id
        self.prompts = prompts
        self.params = params
        self.seq_id = seq_id
        self.engine_ids = [request_id] if len(prompts) == 1 else [f"{request_id}-{k}" for k in range(len(prompts))]
        self._metrics = metrics
        self._observers = [RequestObserver(metrics) for _ in prompts]
        self._closed = False
        self._streams: list[AsyncIterator[RequestOutput]] = []
        self._submits: list[asyncio.Future] = []  # one per engine request tried, in order
        self._attempted = 0
        self._finished: set[int] = set()
        self._cancelled = False

    async def start(self) -> None:
        """Submit every engine request; on any refusal (or our own cancellation) cancel the others."""
        try:
            for k, (rid, ids) in enumerate(zip(self.engine_ids, self.prompts)):
                self._attempted += 1  # counted before the await: a submit we stop waiting for still lands
                submit = asyncio.ensure_future(self.engine.submit(rid, ids, self.params, seq_id=self.seq_id))
                submit.add_done_callback(functools.partial(self._submitted, k))
                self._submits.append(submit)
                # shielded: if our caller is cancelled, the submit still completes and `ended()` can see it
                self._streams.append(await asyncio.shield(submit))
        except BaseException:
            self.cancel()
            raise

    def _submitted(self, k: int, submit: asyncio.Future) -> None:
        """A submit completed after the run was cancelled (its caller had left): cancel what it admitted."""
        if submit.cancelled():
            return
        if submit.exception() is None and self._cancelled:  # (the exception, if any, is retrieved here)
            self.engine.cancel_nowait(self.engine_ids[k])

    async def ended(self) -> None:
        """Wait until every engine request this run submitted has ended; outputs nobody reads are dropped.
        Call it after `close()` or `cancel()` (else it waits for the generation to run to its end)."""
        for k, submit in enumerate(self._submits):
            await asyncio.wait([submit])
            if submit.cancelled() or submit.exception() is not None or k in self._finished:
                continue  # never admitted, or its final output was read
            async for _ in submit.result():
                pass
            self._finished.add(k)

    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    async def events(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        if len(self._streams) == 1:
            async for out in self._one(0):
                yield 0, out
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(k: int) -> None:
            try:
                async for out in self._one(k):
                    await queue.put((k, out))
            except Exception as exc:  # noqa: BLE001 -- re-raised on the consumer side, in order
                await queue.put((k, exc))
            finally:
                await queue.put((k, _END))

        tasks = [asyncio.create_task(pump(k)) for k in range(len(self._streams))]
        try:
            live = len(tasks)
            while live:
                k, item = await queue.get()
                if item is _END:
                    live -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield k, item
        finally:
            for t in tasks:
                t.cancel()

    async def _one(self, k: int) -> AsyncIterator[RequestOutput]:
        observer = self._observers[k]
        async for out in self._streams[k]:
            observer.observe(out)
            if out.finished:
                self._finished.add(k)
            yield out
        self._finished.add(k)

    def close(self) -> None:
        """The consumer is done with this run: cancel what is unfinished and count it as cancelled
        (nobody will read the engine's final `cancelled` output of an abandoned request)."""
        if self._closed:
            return
        self._closed = True
        for k in range(self._attempted):
            if k not in self._finished:
                self._observers[k].abandon(self.params.n)
        self.cancel()

    def cancel(self) -> None:
        """Cancel (at the engine's next tick) every submitted engine request that has not finished.

        Queued after the submits, so it lands after them even if a submit was still in flight (one that
        had not reached the engine yet is cancelled when it completes: `_submitted`)."""
        self._cancelled = True
        for k in range(self._attempted):
            if k not in self._finished:
                self.engine.cancel_nowait(self.engine_ids[k])
