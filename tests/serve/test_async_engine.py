"""`AsyncEngine` against a stand-in engine: the order of the event loop's and the engine
thread's steps, which a real server only meets under load."""

from __future__ import annotations

import asyncio
import threading
import types

from vegas_spec.serve.async_engine import AsyncEngine


class Engine:
    """What `AsyncEngine` reads of an `LLMEngine`: one row, held."""

    tokenizer = None
    max_num_seqs, num_running = 1, 1

    def __init__(self) -> None:
        self.num_waiting, self.added, self.aborted = 0, [], []

    def add_request(self, seq: object) -> None:
        self.added.append(seq)
        self.num_waiting += 1

    def abort(self, rid: str) -> bool:
        self.aborted.append(rid)
        self.num_waiting -= 1
        return True

    def has_unfinished(self) -> bool:
        return False


def test_a_request_whose_client_left_before_it_was_queued_never_takes_a_place() -> None:
    """The client leaves while the request's queueing waits behind the engine thread's
    work: the request is never queued (no place taken, nothing to abort), and nothing
    counts as on its way in."""
    engine = Engine()
    async_engine = AsyncEngine(engine, max_queue=1)  # type: ignore[arg-type]
    gate = threading.Event()
    async_engine._call(lambda: gate.wait(30))  # the engine thread busy (a step)
    seq = types.SimpleNamespace(request_id="r1")

    async def leave() -> None:
        async def consume() -> None:
            async for _ in async_engine.generate(lambda e: seq):
                pass

        task = asyncio.create_task(consume())
        while async_engine._commands.empty():  # its queueing waits behind the step
            await asyncio.sleep(0.01)
        task.cancel()  # the client disconnects
        await asyncio.gather(task, return_exceptions=True)
        gate.set()
        for _ in range(200):
            if async_engine._commands.empty() and async_engine.arriving == 0:
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)  # whatever the engine thread does next, it has done

    try:
        asyncio.run(leave())
        assert engine.added == [] and engine.aborted == []
        assert engine.num_waiting == 0 and async_engine.arriving == 0
    finally:
        gate.set()
        async_engine.shutdown()


def test_a_request_whose_client_stays_is_queued() -> None:
    """The control: the same order with the client still there queues the request."""
    engine = Engine()
    async_engine = AsyncEngine(engine, max_queue=2)  # type: ignore[arg-type]
    seq = types.SimpleNamespace(request_id="r1")

    async def stay() -> None:
        agen = async_engine.generate(lambda e: seq)
        task = asyncio.create_task(agen.__anext__())
        for _ in range(200):
            if engine.added:
                break
            await asyncio.sleep(0.01)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    try:
        asyncio.run(stay())
        assert engine.added == [seq] and async_engine.arriving == 0
    finally:
        async_engine.shutdown()
