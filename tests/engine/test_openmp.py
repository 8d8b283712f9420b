"""sgrt/engine/openmp.py: freeing the calling thread's idle OpenMP pool."""
from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from sgrt.engine import openmp


def test_release_frees_this_threads_pool_and_torch_keeps_working():
    if openmp._libgomp() is None:
        pytest.skip("torch here does not run on libgomp")
    x = torch.randn(512, 512, generator=torch.Generator().manual_seed(0))
    before = x @ x  # a parallel op: this thread now has a worker pool
    assert openmp.release_caller_pool() is True
    assert torch.equal(x @ x, before)  # the next parallel op builds a new pool


def test_release_from_another_thread_leaves_this_one_alone():
    x = torch.randn(256, 256, generator=torch.Generator().manual_seed(1))
    before = x @ x
    results: list[object] = []
    t = threading.Thread(target=lambda: results.append(openmp.release_caller_pool()))
    t.start()
    t.join()
    assert results and isinstance(results[0], bool)
    assert torch.equal(x @ x, before)


def _os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _wait_for_threads(at_most: int, seconds: float = 20.0) -> int:
    """The process's OS thread count once it is <= ``at_most`` (a pool's workers exit shortly
    after it is released), or the count when ``seconds`` have passed (a bound, not a speed check)."""
    deadline = time.monotonic() + seconds
    while _os_threads() > at_most and time.monotonic() < deadline:
        time.sleep(0.02)
    return _os_threads()


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs /proc")
def test_only_a_busy_engine_holds_an_openmp_pool(loaded_model):
    """The caller's pool rebuilt by torch work after the engine started is freed by the next
    submit, and an idle engine gives its own pool back: no idle pool is left to throttle a
    busy loop thread (sgrt/engine/openmp.py). Each pool of 2 threads is one OS worker thread."""
    if openmp._libgomp() is None:
        pytest.skip("torch here does not run on libgomp")
    from sgrt.engine import Engine, SamplingParams

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    engine = Engine(model=loaded_model, max_total_tokens=256, enable_radix_cache=False)
    try:
        params = SamplingParams(max_tokens=3, ignore_eos=True)
        ids = loaded_model.tokenizer.encode("The harbour was quiet that morning")
        engine.generate(ids, params)  # (tokenizer and other lazily started threads)
        time.sleep(1.0)  # (the idle engine's worker exits)
        idle = _os_threads()
        x = torch.randn(512, 512, generator=torch.Generator().manual_seed(2))
        x @ x  # this thread has a 2-thread pool again: one more OS thread
        assert _os_threads() == idle + 1
        assert len(engine.generate(ids, params).token_ids) == 3
        # submit freed this thread's pool; the engine, idle again, freed its own
        assert _wait_for_threads(idle) == idle
    finally:
        engine.shutdown()
        torch.set_num_threads(threads)
