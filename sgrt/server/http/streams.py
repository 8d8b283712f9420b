"""Server-sent events for the HTTP API: framing, an ASGI response that notices the client's
disconnect, waiting on engine work until the client goes away, and merging several requests'
streams (``n`` choices) into one."""
from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.requests import Request

from sgrt.engine import StreamChunk
from sgrt.server.http.errors import BASE_HEADERS, JSON_ENCODER, ClientGone

logger = logging.getLogger("sgrt.server.http")


def sse(obj: Any) -> bytes:
    """One ``data:`` event."""
    return b"data: " + JSON_ENCODER.encode(obj) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


class EventStream:
    """An ASGI response that sends ``events`` (already framed bytes) as ``text/event-stream``.

    It listens for the client's disconnect while it streams: then it stops at once and
    ``on_close`` runs (the caller aborts its engine requests there). ``on_close`` also runs
    after a normal end.
    """

    def __init__(self, events: AsyncIterator[bytes], on_close: Callable[[], None]):
        self.events = events
        self.on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                   (b"x-accel-buffering", b"no")]
        headers += [(k.encode(), v.encode()) for k, v in BASE_HEADERS.items()]

        async def pump() -> None:
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            async for data in self.events:
                await send({"type": "http.response.body", "body": data, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        pump_task = asyncio.ensure_future(pump())
        watch_task = asyncio.ensure_future(wait_disconnect(receive))
        try:
            await asyncio.wait({pump_task, watch_task}, return_when=asyncio.FIRST_COMPLETED)
            if pump_task.done() and pump_task.exception() is not None:
                exc = pump_task.exception()
                if not isinstance(exc, OSError):
                    logger.error("stream failed", exc_info=exc)
        finally:
            # NOTE: first the aborts (no await before them: this may run while being cancelled,
            # e.g. at server shutdown), then the tasks and the generator.
            self.on_close()
            for task in (pump_task, watch_task):
                task.cancel()
            with contextlib.suppress(BaseException):
                await asyncio.gather(pump_task, watch_task, return_exceptions=True)
            with contextlib.suppress(BaseException):
                await self.events.aclose()


async def wait_disconnect(receive: Any) -> None:
    """Return when the client disconnects (the request body has been read already)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def until_disconnect(request: Request, awaitable: Any) -> Any:
    """Await ``awaitable``; if the client disconnects first, cancel it and raise ClientGone."""
    work = asyncio.ensure_future(awaitable)
    watch = asyncio.ensure_future(wait_disconnect(request.receive))
    try:
        done, _ = await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        if work in done:
            return work.result()
        work.cancel()
        raise ClientGone()
    finally:
        watch.cancel()
        if not work.done():
            work.cancel()
        with contextlib.suppress(BaseException):
            await asyncio.gather(work, watch, return_exceptions=True)


async def merge_streams(primed: list[tuple[StreamChunk, AsyncIterator]]) -> AsyncIterator[tuple[int, StreamChunk]]:
    """Interleave several primed streams as ``(index, chunk)`` in arrival order."""
    if len(primed) == 1:
        first, it = primed[0]
        yield 0, first
        if first.finished:
            return
        async for c in it:
            yield 0, c
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, first: StreamChunk, it: AsyncIterator) -> None:
        try:
            await queue.put((i, first, None))
            if not first.finished:
                async for c in it:
                    await queue.put((i, c, None))
        except Exception as exc:  # noqa: BLE001 - handed to the reader
            await queue.put((i, None, exc))

    tasks = [asyncio.ensure_future(pump(i, f, it)) for i, (f, it) in enumerate(primed)]
    open_streams = len(primed)
    try:
        while open_streams:
            i, c, exc = await queue.get()
            if exc is not None:
                raise exc
            if c.finished:
                open_streams -= 1
            yield i, c
    finally:
        for t in tasks:
            t.cancel()
