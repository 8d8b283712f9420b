"""sgrt: an agent-oriented structured-generation runtime for language models."""
from __future__ import annotations

from sgrt.errors import (
    CapacityError,
    ContextLengthExceeded,
    GrammarError,
    InvalidRequest,
    ModelLoadError,
    SgrtError,
)

__version__ = "0.1.0"
