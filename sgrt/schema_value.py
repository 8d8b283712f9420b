"""A ``json_schema`` request value as a JSON Schema: one reading for every place that takes one
(the grammar compiler, ``sgrt.constrained.schema.load_schema``; the HTTP backend's dialects,
``sgrt.backends.dialects.schema_dict``). Light on purpose: no torch, no grammar backend, so a
client-side backend can use it.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any

from sgrt.errors import GrammarError


def schema_value(spec: Any) -> dict | bool:
    """``spec`` as a JSON Schema dict or boolean schema.

    Accepts a dict or a bool (returned as is, not copied), JSON text (an object or a boolean),
    a Pydantic v2 ``BaseModel`` subclass (``model_json_schema()``), a msgspec ``Struct`` type or
    a dataclass type (``msgspec.json.schema``).

    Raises:
        GrammarError: (field ``json_schema``; an ``InvalidRequest``) invalid JSON text, JSON text
            that is neither an object nor a boolean, or a type we cannot read.
    """
    if isinstance(spec, (dict, bool)):
        return spec
    if isinstance(spec, (str, bytes)):
        try:
            value = json.loads(spec)
        except ValueError as e:
            raise GrammarError(f"json_schema is not valid JSON: {e}", field="json_schema") from None
        if not isinstance(value, (dict, bool)):
            raise GrammarError("json_schema must be a JSON object or a boolean", field="json_schema")
        return value
    if isinstance(spec, type):
        if hasattr(spec, "model_json_schema"):  # Pydantic v2
            return spec.model_json_schema()
        import msgspec

        if issubclass(spec, msgspec.Struct) or dataclasses.is_dataclass(spec):
            return msgspec.json.schema(spec)
    raise GrammarError(
        "json_schema must be a dict, JSON text, a Pydantic model, a msgspec Struct or a dataclass, "
        f"got {type(spec).__name__}",
        field="json_schema",
    )
