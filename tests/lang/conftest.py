"""DSL fixtures: one float32 Runtime on the default model for the whole session."""
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

