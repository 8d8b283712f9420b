"""``sglang.srt.constrained``'s helper for programs: :func:`build_regex_from_object`."""
from __future__ import annotations

import json
from typing import Any

from sgrt.errors import GrammarError


def build_regex_from_object(object: Any, whitespace_pattern: str | None = None) -> str:  # noqa: A002
    """A regex whose matches are exactly the JSON values a schema allows (for ``gen(regex=...)``).

    SGLang's helper of the same name (outlines' ``build_regex_from_object``). ``object`` is a
    Pydantic model class, a JSON Schema dict, or its JSON text. ``whitespace_pattern`` is the
    regex for whitespace between JSON tokens (``None``: outlines-core's default).

    The schema goes through sgrt's checks for outlines-core (``sgrt.constrained.outlines_schema``),
    so a keyword outlines-core would silently drop raises instead of widening the regex.
    ``gen(json_schema=...)`` constrains by the schema directly and is usually the better choice.

    Raises:
        GrammarError: the schema cannot be turned into a regex that honours it.
    """
    from outlines_core.json_schema import build_regex_from_schema

    from sgrt.constrained.options import GrammarOptions
    from sgrt.constrained.outlines_schema import patch_regex, prepare
    from sgrt.constrained.schema import normalize_schema

    normalized = normalize_schema(object, GrammarOptions(), backend="outlines")
    prepared = prepare(normalized.schema)
    try:
        regex = build_regex_from_schema(json.dumps(prepared), whitespace_pattern)
    except Exception as e:  # outlines-core raises ValueError / its own error types
        raise GrammarError(f"json_schema could not be turned into a regex (outlines-core): {e}",
                           field="json_schema") from e
    return patch_regex(regex, True)


__all__ = ["build_regex_from_object"]
