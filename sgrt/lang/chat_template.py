"""Chat templates for the DSL: re-exported from :mod:`sgrt.chat_template`, which sits below both
``sgrt.lang`` and ``sgrt.backends`` (both use it)."""
from sgrt.chat_template import (  # noqa: F401 - re-exported
    CHATML, PLAIN, SGLANG_DEFAULT, ChatTemplate, Renderer, chat_template_for, derive_chat_template,
    get_chat_template,
)
