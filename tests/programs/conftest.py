"""Fixtures for the programs' tests: one float32 Runtime on the default model for the session.

Every test asserts structure (types, schema validity, choice membership, counts, the step
limit, cached tokens), never facts: the default model has 135M parameters.
"""
from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def runtime(loaded_model):
    """``sgrt.Runtime`` over the session's loaded default model, set as the default backend."""
    import sgrt

    rt = sgrt.Runtime(model=loaded_model, max_total_tokens=8192)
    previous = sgrt.get_default_backend()
    sgrt.set_default_backend(rt)
    yield rt
    sgrt.set_default_backend(previous)
    rt.shutdown()


def common_prefix_len(a: list[int], b: list[int]) -> int:
    """How many leading token ids ``a`` and ``b`` share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
