"""RequestHandle: a thread iterating a request gets every chunk in order; a thread blocked in
result() is woken by the final chunk only (not by every token the engine pushes)."""
from __future__ import annotations

import threading

from sgrt.engine.handle import RequestHandle
from sgrt.engine.outputs import StreamChunk


class _CountingCondition(threading.Condition):
    def __init__(self) -> None:
        super().__init__()
        self.notified = 0

    def notify_all(self) -> None:
        self.notified += 1
        super().notify_all()


def _push_all(handle: RequestHandle, n: int) -> None:
    for i in range(n):
        handle.push(StreamChunk("r", f"t{i} ", [i]))
    handle.push(StreamChunk("r", "", [], finished=True, result="done"))  # (result's type is not checked here)


def test_result_waiter_is_woken_by_the_final_chunk_only():
    handle = RequestHandle("r", abort=lambda rid: None)
    handle._cond = _CountingCondition()
    got = []
    waiter = threading.Thread(target=lambda: got.append(handle.result(timeout=30)))
    waiter.start()
    _push_all(handle, 50)
    waiter.join(30)
    assert got == ["done"]
    assert handle._cond.notified == 1


def test_iterating_reader_gets_every_chunk_in_order():
    handle = RequestHandle("r", abort=lambda rid: None)
    handle._cond = _CountingCondition()
    started = threading.Event()
    chunks = []

    def read() -> None:
        it = iter(handle)
        started.set()
        chunks.extend(it)

    reader = threading.Thread(target=read)
    reader.start()
    started.wait(30)
    _push_all(handle, 50)
    reader.join(30)
    assert [c.token_ids for c in chunks] == [[i] for i in range(50)] + [[]]
    assert chunks[-1].finished and handle._readers == 0
    # A reader that starts after the pushes still reads them all (no wake-up needed).
    assert [c.text for c in handle][:2] == ["t0 ", "t1 "]
