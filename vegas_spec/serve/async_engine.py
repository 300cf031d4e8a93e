"""The engine behind the event loop: one thread owns the `LLMEngine` and steps it while
requests are in flight; coroutines hand it work through a command queue and receive each
step's outputs on a per-request asyncio queue. A request is built (tokenized and checked:
`LLMEngine.sequence`, which reads the engine's settings and changes nothing) by a pool of
worker threads, so that a large prompt stalls neither the event loop nor the steps; only
queueing it, stepping and aborting touch the engine's state, in its thread."""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from vegas_spec.engine import LLMEngine, RequestOutput
from vegas_spec.sequence import Sequence


class QueueFull(Exception):
    """The bounded queue of waiting requests is full."""


class AsyncEngine:
    def __init__(self, engine: LLMEngine, max_queue: int,
                 on_step: Callable[[LLMEngine, list[RequestOutput]], None] | None = None,
                 on_abort: Callable[[LLMEngine], None] | None = None, workers: int = 2) -> None:
        self.engine, self.max_queue = engine, max_queue
        self.on_step, self.on_abort = on_step, on_abort
        engine.tokenizer  # loaded once, here, before any worker reads it  # noqa: B018
        self._workers = ThreadPoolExecutor(workers, thread_name_prefix="vegas-tokenize")
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stop = threading.Event()
        self._wake = threading.Event()
        self.error: BaseException | None = None
        self.ended = 0  # requests `end_all` aborted
        # requests on their way in (being built, or their command queued): counted until
        # the engine thread queues or refuses them, so that none counts twice, here and as
        # a waiting request
        self._pending = 0
        self._pending_lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="vegas-engine", daemon=True)
        self._thread.start()

    @property
    def arriving(self) -> int:
        """Requests on their way in: being built, or their command not yet run."""
        return self._pending

    # --- from the event loop ------------------------------------------------------------

    async def generate(self, build: Callable[[LLMEngine], Sequence],
                       ) -> AsyncIterator[RequestOutput]:
        """Queue the request that build(engine) makes (in a worker thread: its errors are
        raised here) -> its outputs, step by step. Leaving the iteration early (a client
        that disconnects) aborts the request, which frees its row and pages."""
        loop = asyncio.get_running_loop()
        # refused here, at once, when the queue is already full: not after the step in flight
        # (the engine thread checks again, with the engine's own counts, as it queues it)
        if self._pending + self._beyond_free_rows() >= self.max_queue:
            raise self._full()
        ticket = self._arrive()
        gone = [False]  # its client left before the engine thread queued it
        try:
            seq = await loop.run_in_executor(self._workers, build, self.engine)
            added: asyncio.Future[str | None] = loop.create_future()
            outputs: asyncio.Queue[RequestOutput] = asyncio.Queue()
            self._call(lambda: self._add(seq, loop, outputs, added, ticket, gone))
            try:
                rid = await asyncio.shield(added)
            except asyncio.CancelledError:  # gone before its id came back: never queued, or
                gone[0] = True  # aborted once it is
                added.add_done_callback(self._abort_when_added)
                raise
        finally:
            self._arrived(ticket)  # refused or failed before the engine thread saw it
        finished = False
        try:
            while not finished:
                out = await outputs.get()
                finished = out.finished
                yield out
        finally:
            if not finished:
                self._call(lambda: self._abort(rid))

    async def run(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """fn(engine) in the engine thread -> its result."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[Any] = loop.create_future()

        def call() -> None:
            try:
                result = fn(self.engine)
            except Exception as e:  # noqa: BLE001 - handed to the caller
                loop.call_soon_threadsafe(_settle, done, None, e)
            else:
                loop.call_soon_threadsafe(_settle, done, result, None)

        self._call(call)
        return await done

    def _arrive(self) -> list[bool]:
        """A request on its way in: counted in `_pending` until `_arrived(ticket)`."""
        with self._pending_lock:
            self._pending += 1
        return [True]

    def _arrived(self, ticket: list[bool]) -> None:
        """The request is queued in the engine or refused (once per ticket, either thread)."""
        with self._pending_lock:
            if ticket[0]:
                ticket[0] = False
                self._pending -= 1

    def _beyond_free_rows(self) -> int:
        """Waiting requests that no free row will take: those that arrived since the last
        step wait only for it while rows are free, so the queue bound counts these. Read
        from the event loop too (two list lengths: a count a step may move by one)."""
        free = max(self.engine.max_num_seqs - self.engine.num_running, 0)
        return self.engine.num_waiting - free

    def _full(self) -> QueueFull:
        return QueueFull(f"{self.max_queue} requests are waiting for a row, the most this "
                         "server queues; retry later")

    def end_all(self) -> None:
        """Abort every request (a shutdown's grace period is over): each gets its last
        output, finish reason "abort", so its response ends cleanly. Thread-safe."""
        self._call(self._end_all)

    def _end_all(self) -> None:
        for rid in list(self._streams):
            seq = self.engine.seqs.get(rid)
            if seq is None or not self.engine.abort(rid):
                continue
            loop, outputs = self._streams.pop(rid)
            text, ids = seq.delta()
            out = RequestOutput(seq.prompt, seq.prompt_ids, seq.text, list(seq.output), "abort",
                                {}, rid, text, ids)
            loop.call_soon_threadsafe(outputs.put_nowait, out)
            self.ended += 1
            if self.on_abort is not None:
                self.on_abort(self.engine)

    def _abort_when_added(self, added: asyncio.Future) -> None:
        if not added.cancelled() and added.exception() is None:
            rid = added.result()
            if rid is not None:  # None: never queued
                self._call(lambda: self._abort(rid))

    def shutdown(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=30)
        self._workers.shutdown(wait=False, cancel_futures=True)

    # --- in the engine thread -----------------------------------------------------------

    def _call(self, command: Callable[[], None]) -> None:
        self._commands.put(command)
        self._wake.set()

    def _add(self, seq: Sequence, loop: asyncio.AbstractEventLoop, outputs: asyncio.Queue,
             added: asyncio.Future, ticket: list[bool], gone: list[bool]) -> None:
        """Queues seq in the engine (its id to `added`), unless its client has left (None to
        `added`: it never holds a place in the queue) or the queue is full (`QueueFull`)."""
        if gone[0]:
            self._arrived(ticket)
            loop.call_soon_threadsafe(_settle, added, None, None)
            return
        try:
            if self._beyond_free_rows() >= self.max_queue:
                raise self._full()
            self.engine.add_request(seq)
        except Exception as e:  # noqa: BLE001 - handed to the request's coroutine
            loop.call_soon_threadsafe(_settle, added, None, e)
            return
        finally:
            self._arrived(ticket)
        self._streams[seq.request_id] = (loop, outputs)
        loop.call_soon_threadsafe(_settle, added, seq.request_id, None)

    def _abort(self, rid: str) -> None:
        if self.engine.abort(rid) and self.on_abort is not None:
            self.on_abort(self.engine)
        self._streams.pop(rid, None)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._drain()
            if not self.engine.has_unfinished():
                self._wake.wait(0.5)
                self._wake.clear()
                continue
            try:
                outs = self.engine.step()
            except BaseException as e:  # noqa: BLE001 - every request fails, the server lives
                self.error = e
                self._fail_all()
                continue
            if self.on_step is not None:
                self.on_step(self.engine, outs)
            self._deliver(outs)

    def _drain(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            command()

    def _deliver(self, outs: list[RequestOutput]) -> None:
        for out in outs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if out.finished:
                del self._streams[out.request_id]
            loop, outputs = stream
            loop.call_soon_threadsafe(outputs.put_nowait, out)

    def _fail_all(self) -> None:
        """After a failed step: every request ends (finish_reason "error") and every page
        comes back."""
        self.engine.abort_all()
        for rid, (loop, outputs) in list(self._streams.items()):
            out = RequestOutput("", [], "", [], "error", {}, rid)
            loop.call_soon_threadsafe(outputs.put_nowait, out)
        self._streams.clear()


def _settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
