"""``extract``: text to JSON under a JSON Schema.

The reply is generated under the schema (``sgrt.gen(json_schema=...)``, compiled to a token
mask by ``sgrt.constrained``), so it parses and validates whatever the model "wants" to say;
strings the schema leaves unbounded are capped (``GrammarOptions.max_string_length``), so a
small model cannot ramble inside one forever. Forced runs such as ``{"name":"`` are
jump-forwarded (meta info ``forced_tokens``).

Over the session server::

    {"type": "session.start", "session": "x1", "program": "extract",
     "args": {"text": "Ada Lovelace was born in London in 1815.",
              "schema": {"type": "object", "properties": {"name": {"type": "string"},
                         "year": {"type": "integer"}}, "required": ["name", "year"]}}}
"""
from __future__ import annotations

import json
from typing import Any

import sgrt

#: Used when no schema is given: the topic, up to four named entities with their kind, a summary.
DEFAULT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "topic": {"type": "string", "maxLength": 40},
        "entities": {
            "type": "array",
            "items": {"type": "object",
                      "properties": {"name": {"type": "string", "maxLength": 40},
                                     "kind": {"enum": ["person", "place", "organization", "date", "thing"]}},
                      "required": ["name", "kind"]},
            "maxItems": 4,
        },
        "summary": {"type": "string", "maxLength": 100},
    },
    "required": ["topic", "entities", "summary"],
}


@sgrt.function
def extract(s, text: str, schema: dict[str, Any] | None = None,
            instructions: str = "Extract the information from the text as JSON.", max_tokens: int = 128):
    """Read ``text`` and reply with one JSON value that matches ``schema``.

    Inputs:
        text: the text to read.
        schema: a JSON Schema (dict; a Pydantic model class or dataclass works too when called
            from Python); default :data:`DEFAULT_SCHEMA`. It is shown to the model and
            enforced during decoding.
        instructions: what to extract, in words.
        max_tokens: the most tokens of the JSON reply.

    Variables:
        ``json``: the JSON text (str); its meta info has ``finish_reason`` (``{"type": "stop",
        "matched": "grammar"}`` when the value is complete; type ``"length"``, and
        ``incomplete``, when ``max_tokens`` cut it short) and ``forced_tokens``.
        ``data``: the parsed value, or ``None`` if the reply was cut short.

    Shows: JSON Schema constrained decoding, jump-forward over forced tokens.
    """
    schema = DEFAULT_SCHEMA if schema is None else schema
    shown = schema if isinstance(schema, dict) else _schema_dict(schema)
    s += sgrt.system("You are a precise information extraction system. You reply with JSON only.")
    s += sgrt.user(instructions + "\nJSON Schema: " + json.dumps(shown, separators=(",", ":"))
                   + "\n\nText:\n" + text)
    s += sgrt.assistant(sgrt.gen("json", json_schema=schema, max_tokens=max_tokens))
    s["data"] = _parse(s["json"], s.get_meta_info("json"))


def _parse(text: str, meta: dict[str, Any] | None) -> Any:
    """The JSON value of a finished reply; ``None`` for one cut short by ``max_tokens``."""
    if meta and meta.get("incomplete"):
        return None
    try:
        return json.loads(text)
    except ValueError:  # NOTE: only a cut-short reply can fail: the grammar admits valid JSON only
        return None


def _schema_dict(schema: Any) -> dict[str, Any]:
    """A Pydantic model / dataclass / msgspec type as the JSON Schema dict the engine will use."""
    from sgrt.constrained import load_schema

    return load_schema(schema)
