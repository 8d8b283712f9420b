"""Process-wide settings of the DSL, under SGLang's names (``sglang.global_config``).

    from sgrt.global_config import global_config
    global_config.default_backend = sgrt.Runtime()   # same as sgrt.set_default_backend(...)

``sgrt.global_config`` (the package attribute) is this module's :data:`global_config` object, as
``sglang.global_config`` is in SGLang. Each field says what it does in sgrt.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class GlobalConfig:
    """Settings read by ``sgrt.lang`` at run time (after SGLang's ``GlobalConfig``).

    Attributes:
        verbosity: 2 or more prints each program's whole text when ``run()`` returns (SGLang's
            meaning); below 2 prints nothing.
        default_backend: the backend programs use when ``run()`` gets none
            (:func:`sgrt.set_default_backend` writes it).
        skip_special_tokens_in_output: when False, generated special tokens (``<|im_end|>``...)
            are kept in the text (the engine's ``skip_special_tokens=False``).
        spaces_between_special_tokens_in_out: accepted for SGLang programs; no effect: sgrt's
            detokenizer never inserts spaces between special tokens.
        enable_precache_with_tracing: ``run_batch`` puts the programs' common constant prefix
            into the prefix cache before dispatch (prefix hinting); False turns that off.
        enable_parallel_encoding: accepted; no effect: ``join(mode="concate_and_append")``
            always appends the branches' text (SGLang's server has no KV-concatenation endpoint
            either, so its programs get the same text).
    """

    verbosity: int = 0
    default_backend: Any = None
    skip_special_tokens_in_output: bool = True
    spaces_between_special_tokens_in_out: bool = True
    enable_precache_with_tracing: bool = True
    enable_parallel_encoding: bool = True


#: The one settings object (``sgrt.global_config``).
global_config = GlobalConfig()
