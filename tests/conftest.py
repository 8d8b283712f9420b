"""Shared fixtures: the default model and its tokenizer, loaded once per test session.

Both read the cache (``$SGRT_CACHE_DIR`` or ``~/.cache/sgrt``); on a fresh machine the first
session reads the default model's GGUF into it once (its tokenizer and packed weights, seconds).
"""
from __future__ import annotations

import os

# NOTE: set before anything imports transformers / huggingface_hub: tests never touch a hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def loaded_model():
    """The default model (SmolLM2-135M-Instruct), float32 on cpu: a ``sgrt.models.LoadedModel``."""
    from sgrt.models import load_model

    return load_model("smollm2-135m-instruct", dtype="float32", device="cpu")


@pytest.fixture(scope="session")
def tokenizer():
    """The default model's ``sgrt.models.Tokenizer`` (no weights loaded)."""
    from sgrt.models import load_tokenizer

    return load_tokenizer("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def runtime(loaded_model):
    """``sgrt.Runtime`` over the session's loaded default model, set as the default backend
    (the DSL's and the programs' tests)."""
    import sgrt

    rt = sgrt.Runtime(model=loaded_model, max_total_tokens=8192)
    previous = sgrt.get_default_backend()
    sgrt.set_default_backend(rt)
    yield rt
    sgrt.set_default_backend(previous)
    rt.shutdown()


@pytest.fixture(autouse=True)
def _runtime_idle_first(request):
    """Before a test that uses ``runtime``, wait until its engine has nothing running or waiting.

    A program's ``run()`` returns before its gens finish (SGLang's executor thread); a test that
    ends without waiting for them must not leave requests decoding into the next test, whose
    cache and pool assertions would then depend on test order and timing. The bound is generous
    (a loaded 2-core machine); it checks no speed.
    """
    engine = getattr(request.getfixturevalue("runtime"), "engine", None) if "runtime" in request.fixturenames else None
    # NOTE: some modules override ``runtime`` with a RuntimeEndpoint (no local engine to wait on).
    if engine is not None and callable(getattr(engine, "stats", None)):
        import time

        deadline = time.monotonic() + 600
        while (stats := engine.stats())["running"] or stats["waiting"]:
            assert time.monotonic() < deadline, f"the session runtime is still busy: {stats}"
            time.sleep(0.02)
    yield
