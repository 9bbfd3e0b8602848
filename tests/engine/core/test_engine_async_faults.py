"""AsyncEngine under callers that give up, and a loop that dies.

- A command whose caller is cancelled while it waits in the queue never runs, and the loop lives on
  (before the fix, completing the cancelled future raised InvalidStateError and killed the thread).
- A command that already ran when its caller was cancelled is undone: no orphan sequence, no request
  nobody reads.
- If the loop dies anyway, every in-flight request ends with an error, queued and later commands fail
  at once with EngineUnavailable (never hang), `on_failure` hears why, and shutdown returns.
"""

import asyncio
import threading
import time

import pytest
from engine_support import ASYNC_TIMEOUT_S, greedy, greedy_oracle, make_engine, prompt, run_async

from engine.api.errors import EngineUnavailable
from engine.core.async_engine import AsyncEngine


def _block_loop(aeng: AsyncEngine) -> threading.Event:
    """Occupy the loop thread until the returned event is set, so later commands stay queued."""
    gate, entered = threading.Event(), threading.Event()

    def hold() -> None:
        entered.set()
        gate.wait(ASYNC_TIMEOUT_S)

    aeng._commands.put((hold, None))
    assert entered.wait(ASYNC_TIMEOUT_S)
    return gate


def _wait_until(predicate, timeout: float = 10.0) -> None:
    """Block the calling thread (the event loop too, on purpose) until `predicate()` holds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_commands_cancelled_while_queued_never_run_and_the_loop_survives(model):
    aeng = AsyncEngine.launch(lambda: make_engine(model=model, n_cells=256))
    p = prompt(8, seed=1)

    async def main():
        info = await aeng.create_sequence(p)
        gate = _block_loop(aeng)
        tasks = [asyncio.create_task(aeng.fork(info.seq_id)),
                 asyncio.create_task(aeng.create_sequence(p)),
                 asyncio.create_task(aeng.submit("gone", p, greedy(5)))]
        await asyncio.sleep(0.05)  # all three are queued behind the blocked loop
        for t in tasks:
            t.cancel()
        gate.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        stream = await aeng.submit("after", p, greedy(6))
        tokens = [t async for out in stream for c in out.outputs for t in c.token_ids]
        listed = [s.seq_id for s in await aeng.list_sequences()]
        await aeng.shutdown()
        return info.seq_id, listed, tokens

    seq_id, listed, tokens = run_async(main())
    assert listed == [seq_id]  # neither the fork nor the second create happened
    assert tokens == greedy_oracle(model, p, 6)
    assert aeng.failure is None and "gone" not in aeng.engine.requests


def test_commands_that_ran_before_their_caller_left_are_undone(model):
    aeng = AsyncEngine.launch(lambda: make_engine(model=model, n_cells=256))
    engine = aeng.engine
    p = prompt(8, seed=2)

    async def main():
        info = await aeng.create_sequence(p)
        # The event loop is blocked while the engine applies each command, so the caller is cancelled
        # after the command ran but before it could see the result.
        fork = asyncio.create_task(aeng.fork(info.seq_id))
        await asyncio.sleep(0)
        _wait_until(lambda: len(engine.sequences) == 2)
        fork.cancel()
        submit = asyncio.create_task(aeng.submit("left", p, greedy(150)))
        await asyncio.sleep(0)
        _wait_until(lambda: "left" in engine.requests or engine.generated_tokens > 0)
        submit.cancel()
        await asyncio.gather(fork, submit, return_exceptions=True)
        for _ in range(200):  # the undo commands run at the next step boundaries
            if len(await aeng.list_sequences()) == 1 and "left" not in engine.requests:
                break
            await asyncio.sleep(0.01)
        listed = [s.seq_id for s in await aeng.list_sequences()]
        await aeng.delete(info.seq_id)
        await aeng.shutdown()
        return info.seq_id, listed

    seq_id, listed = run_async(main())
    assert listed == [seq_id] and "left" not in engine.requests
    assert engine.free_cells() == 256 and aeng.failure is None


class _Fatal(BaseException):
    """Something no per-request handler catches (as a MemoryError or a C-level abort would be)."""


def test_a_dead_loop_fails_in_flight_work_and_refuses_new_work(model):
    aeng = AsyncEngine.launch(lambda: make_engine(model=model, n_cells=256))
    heard: list[str] = []
    aeng.on_failure = heard.append
    real_step = aeng.engine.step
    calls = {"n": 0}

    def dying_step():
        calls["n"] += 1
        if calls["n"] > 3:
            raise _Fatal("boom")
        return real_step()

    aeng.engine.step = dying_step

    async def main():
        stream = await aeng.submit("r", prompt(6, seed=5), greedy(50))
        outs = [out async for out in stream]
        with pytest.raises(EngineUnavailable, match="boom"):
            await aeng.list_sequences()
        with pytest.raises(EngineUnavailable, match="boom"):
            await aeng.submit("r2", prompt(6, seed=5), greedy(5))
        await aeng.shutdown(grace_s=30)  # returns at once: there is nothing left to wait for
        return outs

    started = time.monotonic()
    outs = run_async(main())
    last = outs[-1]
    assert last.finished and last.outputs[0].finish_reason == "error" and "boom" in last.outputs[0].error
    assert heard and "boom" in heard[0] and "boom" in aeng.failure
    assert time.monotonic() - started < 25  # shutdown did not sit out its 30 s grace
