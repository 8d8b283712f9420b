"""The caller's side of a request: wait for its result or stream its chunks, from a thread or
an asyncio task. The engine loop thread pushes; any number of readers may wait."""
from __future__ import annotations

import asyncio
import threading
from typing import AsyncIterator, Callable, Iterator

from sgrt.engine.outputs import Result, StreamChunk


class RequestHandle:
    """A submitted request. Thread-safe; usable from asyncio (``aresult``, ``astream``).

    ``result()`` returns the :class:`Result` (``finish_reason="abort"`` with ``error`` set when
    the request failed), except that a request refused before it ran (for example a
    ``GrammarError`` from compiling its constraint) re-raises that exception.
    """

    def __init__(self, request_id: str, abort: Callable[[str], None]):
        self.request_id = request_id
        self._abort = abort
        self._cond = threading.Condition()
        self._chunks: list[StreamChunk] = []
        self._result: Result | None = None
        self._exception: BaseException | None = None
        self._async_waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []
        self._readers = 0  # threads iterating the chunks (they are woken by every chunk)

    # -- engine side -------------------------------------------------------------------------
    def push(self, chunk: StreamChunk) -> None:
        with self._cond:
            self._chunks.append(chunk)
            if chunk.finished:
                self._result = chunk.result
            # NOTE: result() waits for the final chunk only; waking it for every token costs the
            # engine a thread switch a step (on a 2-core machine, on a core a matmul is using).
            if chunk.finished or self._readers:
                self._cond.notify_all()
            waiters = list(self._async_waiters)
        for loop, event in waiters:
            try:
                loop.call_soon_threadsafe(event.set)
            except RuntimeError:  # the reader's loop is closed
                pass

    def fail(self, exc: BaseException, result: Result) -> None:
        """Finish with an exception that ``result()`` re-raises."""
        self._exception = exc
        self.push(StreamChunk(self.request_id, "", [], finished=True, result=result))

    # -- caller side -------------------------------------------------------------------------
    @property
    def done(self) -> bool:
        return self._result is not None

    def abort(self) -> None:
        """Ask the engine to stop this request and free its KV slots."""
        self._abort(self.request_id)

    def result(self, timeout: float | None = None) -> Result:
        """Block until finished. Raises ``TimeoutError`` after ``timeout`` seconds."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._result is not None, timeout):
                raise TimeoutError(f"request {self.request_id} not finished after {timeout} s")
        if self._exception is not None:
            raise self._exception
        return self._result

    def __iter__(self) -> Iterator[StreamChunk]:
        """Yield chunks as they arrive, ending with the ``finished`` one."""
        i = 0
        with self._cond:
            self._readers += 1
        try:
            while True:
                with self._cond:
                    self._cond.wait_for(lambda: len(self._chunks) > i)
                    chunk = self._chunks[i]
                i += 1
                if chunk.finished and self._exception is not None:
                    raise self._exception
                yield chunk
                if chunk.finished:
                    return
        finally:
            with self._cond:
                self._readers -= 1

    async def astream(self) -> AsyncIterator[StreamChunk]:
        """Async version of iteration."""
        loop = asyncio.get_running_loop()
        event = asyncio.Event()
        with self._cond:
            self._async_waiters.append((loop, event))
        i = 0
        try:
            while True:
                with self._cond:
                    available = self._chunks[i:]
                    if not available:
                        event.clear()
                if not available:
                    await event.wait()
                    continue
                for chunk in available:
                    i += 1
                    if chunk.finished and self._exception is not None:
                        raise self._exception
                    yield chunk
                    if chunk.finished:
                        return
        finally:
            with self._cond:
                self._async_waiters.remove((loop, event))

    async def aresult(self) -> Result:
        """Await the final :class:`Result` (same errors as :meth:`result`)."""
        async for chunk in self.astream():
            if chunk.finished:
                return chunk.result
        raise RuntimeError("stream ended without a result")
