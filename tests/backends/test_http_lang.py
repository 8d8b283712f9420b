"""The DSL's own test programs (tests/lang/test_programs.py), run through ``RuntimeEndpoint``
against an sgrt HTTP server instead of the in-process ``Runtime``.

The programs and their assertions are imported unchanged; only the ``runtime`` fixture differs:
here it is a ``RuntimeEndpoint`` (which has the same ``encode``, ``flush_cache`` and
``apply_chat_template`` the tests use), set as the default backend.
"""
from __future__ import annotations

import pytest

import sgrt

from tests.server.conftest_http import http_engine, http_server  # noqa: F401 - fixtures

programs = pytest.importorskip("tests.lang.test_programs")
globals().update({name: getattr(programs, name) for name in dir(programs) if name.startswith("test_")})


@pytest.fixture(scope="module")
def runtime(http_server):
    """``RuntimeEndpoint`` over the module's sgrt server, as the default backend."""
    from sgrt.backends.http import RuntimeEndpoint

    endpoint = RuntimeEndpoint(http_server.url)
    assert endpoint.dialect == "sgrt"
    previous = sgrt.get_default_backend()
    sgrt.set_default_backend(endpoint)
    yield endpoint
    sgrt.set_default_backend(previous)
    endpoint.shutdown()
