"""The engine freezes the heap it starts with out of the cyclic GC while it runs
(sgrt/engine/engine.py, DESIGN.md "Engine threads and OpenMP"), and the last engine to shut
down unfreezes it."""
from __future__ import annotations

import gc

import pytest

from sgrt.engine import Engine, SamplingParams
from sgrt.engine import engine as engine_mod


def _gc_sees(obj: object) -> bool:
    """Whether the collector's generations hold ``obj`` (frozen objects are in none of them)."""
    return any(o is obj for o in gc.get_objects())


def test_the_startup_heap_is_frozen_while_an_engine_runs_and_unfrozen_after(loaded_model):
    if engine_mod._LIVE_ENGINES or gc.get_freeze_count():
        pytest.skip("another engine (or the process itself) already froze the heap")
    before = [object()]  # a tracked container that exists when the engine starts
    assert _gc_sees(before)
    engine = Engine(model=loaded_model, max_total_tokens=256, enable_radix_cache=False)
    try:
        assert gc.get_freeze_count() > 0 and not _gc_sees(before)
        ids = loaded_model.tokenizer.encode("The harbour was quiet")
        assert len(engine.generate(ids, SamplingParams(max_tokens=3, ignore_eos=True)).token_ids) == 3
        after = [object()]
        assert _gc_sees(after)  # objects made while it runs are collected as usual
    finally:
        engine.shutdown()
    assert gc.get_freeze_count() == 0 and _gc_sees(before)


def test_a_heap_the_process_froze_itself_stays_frozen(loaded_model):
    if engine_mod._LIVE_ENGINES or gc.get_freeze_count():
        pytest.skip("another engine (or the process itself) already froze the heap")
    gc.freeze()
    try:
        engine = Engine(model=loaded_model, max_total_tokens=256, enable_radix_cache=False)
        engine.shutdown()
        assert gc.get_freeze_count() > 0  # the process's own freeze is not undone
    finally:
        gc.unfreeze()
