"""sgrt/engine/openmp.py: freeing the calling thread's idle OpenMP pool."""
from __future__ import annotations

import threading

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
