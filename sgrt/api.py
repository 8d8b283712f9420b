"""The frontend language's public functions at SGLang's module path (``sglang.api``).

``from sgrt.api import function, gen, set_default_backend`` works as SGLang's
``from sglang.api import ...`` does; every name is the one in :mod:`sgrt.lang` (see
``sgrt.lang.api`` for the deliberate differences from SGLang).
"""
from __future__ import annotations

from typing import Any

from sgrt.lang.api import (
    assistant,
    assistant_begin,
    assistant_end,
    flush_cache,
    gen,
    gen_int,
    gen_string,
    get_default_backend,
    get_server_info,
    image,
    select,
    separate_reasoning,
    set_default_backend,
    system,
    system_begin,
    system_end,
    user,
    user_begin,
    user_end,
    video,
)
from sgrt.lang.function import function

__all__ = [
    "Runtime", "RuntimeEndpoint", "assistant", "assistant_begin", "assistant_end", "flush_cache",
    "function", "gen", "gen_int", "gen_string", "get_default_backend", "get_server_info",
    "image", "select", "separate_reasoning", "set_default_backend", "system", "system_begin",
    "system_end", "user", "user_begin", "user_end", "video",
]


def Runtime(*args: Any, **kwargs: Any) -> Any:  # noqa: N802 - SGLang's name
    """``sgrt.runtime.Runtime`` (imported on first use: it loads torch and the engine)."""
    from sgrt.runtime import Runtime as _Runtime

    return _Runtime(*args, **kwargs)


def RuntimeEndpoint(*args: Any, **kwargs: Any) -> Any:  # noqa: N802 - SGLang's name
    """``sgrt.backends.http.RuntimeEndpoint``."""
    from sgrt.backends.http import RuntimeEndpoint as _RuntimeEndpoint

    return _RuntimeEndpoint(*args, **kwargs)
