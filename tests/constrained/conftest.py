"""Fixtures for the constrained-decoding tests: one GrammarCompiler per session.

The ``tokenizer`` fixture (the default model's tokenizer, no weights) comes from
tests/conftest.py.
"""
from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def compiler(tokenizer):
    """A GrammarCompiler over the default tokenizer, masks as wide as its vocabulary (49152)."""
    from sgrt.constrained import GrammarCompiler

    return GrammarCompiler(tokenizer, tokenizer.vocab_size, compile_timeout_s=30.0)
