"""AsyncEngine: the Engine on its own thread, driven from asyncio — concurrent submits equal solo
runs, refusals raise from the awaited call, cancel_nowait ends a stream, persistent-sequence verbs,
and shutdown cancels what is left and stops the thread."""

import asyncio

import pytest
from engine_support import ASYNC_TIMEOUT_S, greedy, greedy_oracle, make_engine, prompt, run_async

from engine.api.errors import (
    EngineUnavailable,
    InvalidRequest,
    PromptTooLong,
    RequestNotFound,
    SequenceNotFound,
)
from engine.core.async_engine import AsyncEngine


async def _collect(stream) -> tuple[list[int], str | None, int]:
    """(tokens, finish_reason, number of deltas) of choice 0."""
    tokens, finish, n = [], None, 0
    async for out in stream:
        n += 1
        for c in out.outputs:
            tokens += c.token_ids
            finish = c.finish_reason or finish
    return tokens, finish, n


def test_concurrent_submits_equal_solo_runs(model):
    prompts = [prompt(3 + 4 * i, seed=i) for i in range(6)]
    aeng = AsyncEngine.launch(lambda: make_engine(model=model, n_cells=256))

    async def main():
        streams = [await aeng.submit(f"r{i}", p, greedy(8)) for i, p in enumerate(prompts)]
        results = await asyncio.gather(*(_collect(s) for s in streams))
        await aeng.shutdown()
        return results

    results = run_async(main())
    for p, (tokens, finish, n) in zip(prompts, results):
        assert finish == "length" and tokens == greedy_oracle(model, p, 8)
        assert n >= 2, "outputs stream as deltas"
    assert aeng.engine.free_cells() == 256
    assert aeng.stats().generated_tokens == 48


def test_refusals_raise_from_the_awaited_call(model):
    aeng = AsyncEngine.launch(lambda: make_engine(model=model, n_cells=64))

    async def main():
        with pytest.raises(InvalidRequest):
            await aeng.submit("x", [], greedy(3))
        with pytest.raises(PromptTooLong):
            await aeng.submit("x", prompt(60, 1), greedy(10))
        with pytest.raises(SequenceNotFound):
            await aeng.submit("x", [5], greedy(3), seq_id="nope")
        with pytest.raises(RequestNotFound):
            await aeng.cancel("nope")
        aeng.cancel_nowait("nope")  # harmless
        tokens, finish, _ = await _collect(await aeng.submit("x", [5, 6], greedy(4)))  # the engine still serves
        await aeng.shutdown()
        return tokens, finish

    tokens, finish = run_async(main())
    assert finish == "length" and tokens == greedy_oracle(model, [5, 6], 4)


def test_cancel_nowait_ends_the_stream_and_frees_cells(model):
    aeng = AsyncEngine.launch(lambda: make_engine(model=model, n_cells=256))

    async def main():
        stream = await aeng.submit("long", prompt(10, 2), greedy(200))
        first = await stream.__anext__()
        aeng.cancel_nowait("long")
        tokens, finish, _ = await _collect(stream)
        await aeng.shutdown()
        return first.outputs[0].token_ids + tokens, finish

    tokens, finish = run_async(main())
    assert finish == "cancelled" and 1 <= len(tokens) < 200
    assert tokens == greedy_oracle(model, prompt(10, 2), len(tokens))
    assert aeng.engine.free_cells() == 256


def test_persistent_sequence_verbs(model):
    aeng = AsyncEngine.launch(lambda: make_engine(model=model, n_cells=128))
    p = prompt(9, seed=3)

    async def main():
        info = await aeng.create_sequence(p)
        assert (info.length, info.n_cached, info.status) == (9, 8, "idle")
        tokens, finish, _ = await _collect(await aeng.submit("c", [4], greedy(5), seq_id=info.seq_id))
        child = await aeng.fork(info.seq_id, at=6)
        short = await aeng.truncate(info.seq_id, 7)
        listed = {s.seq_id for s in await aeng.list_sequences()}
        await aeng.delete(child.seq_id)
        with pytest.raises(SequenceNotFound):
            await aeng.sequence_info(child.seq_id)
        await aeng.shutdown()
        return tokens, finish, child, short, listed, info.seq_id

    tokens, finish, child, short, listed, seq_id = run_async(main())
    assert finish == "length" and tokens == greedy_oracle(model, p + [4], 5)
    assert child.token_ids == p[:6] and child.cells_shared == 5 and child.parent == seq_id
    assert short.token_ids == p[:7] and listed == {seq_id, child.seq_id}
    engine = aeng.engine
    engine.delete(seq_id)
    assert engine.free_cells() == 128 and not engine.has_unfinished()


def test_shutdown_lets_short_work_finish_within_grace(model):
    aeng = AsyncEngine.launch(lambda: make_engine(model=model, n_cells=256))

    async def main():
        stream = await aeng.submit("short", prompt(6, 5), greedy(4))
        await aeng.shutdown(grace_s=ASYNC_TIMEOUT_S)
        return await _collect(stream)

    tokens, finish, _ = run_async(main())
    assert finish == "length" and tokens == greedy_oracle(model, prompt(6, 5), 4)


def test_shutdown_cancels_what_is_left_and_refuses_new_work(model):
    aeng = AsyncEngine.launch(lambda: make_engine(model=model, n_cells=256))

    async def main():
        stream = await aeng.submit("long", prompt(10, 4), greedy(240))
        await stream.__anext__()
        await aeng.shutdown(grace_s=0)  # commands are applied before every step: the cancel comes first
        _, finish, _ = await _collect(stream)
        with pytest.raises(EngineUnavailable):
            await aeng.submit("late", [5], greedy(2))
        return finish

    assert run_async(main()) == "cancelled"
    assert not aeng.accepting and not aeng._thread.is_alive()
    assert aeng.engine.free_cells() == 256 and not aeng.engine.has_unfinished()


def test_launch_builds_the_engine_on_the_thread_that_runs_it(model):
    """All torch work on one thread (see engine/core/async_engine.py): the builder runs on the loop thread."""
    import threading

    seen: dict[str, threading.Thread] = {}

    def build():
        seen["build"] = threading.current_thread()
        engine = make_engine(model=model, n_cells=64)
        step = engine.step

        def recording_step():
            seen["step"] = threading.current_thread()
            return step()

        engine.step = recording_step
        return engine

    aeng = AsyncEngine.launch(build, model_name="tiny")
    assert aeng.accepting and aeng.model_name == "tiny"

    async def main():
        tokens, finish, _ = await _collect(await aeng.submit("r", prompt(5, seed=3), greedy(4)))
        await aeng.shutdown()
        return tokens, finish

    tokens, finish = run_async(main())
    assert finish == "length" and tokens == greedy_oracle(model, prompt(5, seed=3), 4)
    assert seen["build"] is seen["step"] is not threading.main_thread()
    assert not seen["build"].is_alive()


def test_launch_raises_what_the_builder_raised():
    def build():
        raise FileNotFoundError("no model folder at /nowhere")

    with pytest.raises(FileNotFoundError, match="/nowhere"):
        AsyncEngine.launch(build)
