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

# ---- the DSL (sgrt.lang) and its backends; Runtime / LocalBackend load the engine lazily ----
from sgrt.lang import (  # noqa: E402
    ChatTemplate,
    assistant,
    assistant_begin,
    assistant_end,
    flush_cache,
    function,
    gen,
    gen_int,
    gen_string,
    get_default_backend,
    get_server_info,
    greedy_token_selection,
    image,
    select,
    separate_reasoning,
    set_default_backend,
    system,
    system_begin,
    system_end,
    token_length_normalized,
    unconditional_likelihood_normalized,
    user,
    user_begin,
    user_end,
    video,
)

# NOTE: as in SGLang, the package attribute is the settings object; importing the submodule
# first (this line) means a later ``from sgrt.global_config import global_config`` does not
# rebind the attribute to the module.
from sgrt.global_config import global_config  # noqa: E402


def __getattr__(name: str):
    if name == "Runtime":
        from sgrt.runtime import Runtime

        return Runtime
    if name == "LocalBackend":
        from sgrt.backends.local import LocalBackend

        return LocalBackend
    if name == "RuntimeEndpoint":
        from sgrt.backends.http import RuntimeEndpoint

        return RuntimeEndpoint
    raise AttributeError(f"module 'sgrt' has no attribute {name!r}")
