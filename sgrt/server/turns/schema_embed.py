"""Embedding a user's JSON Schema inside one of ours without breaking its references.

A tool's ``parameters`` (or any user schema) is a root schema: its local references point from
*its* root (``#/$defs/Address``, ``#`` for recursion). Put it under ``properties.arguments`` of a
call schema and those pointers resolve against the wrong root (llguidance: ``Pointer
'/$defs/Address' does not exist``). :func:`embed_schema` makes the embedded copy self-consistent
with the new root:

- its ``$defs`` / ``definitions`` move to the new root's ``$defs`` under a prefixed name
  (``<prefix>Address``), so two embedded schemas never clash;
- every local ``$ref`` is rewritten: into a hoisted definition -> the renamed one; to ``#`` or
  any other pointer -> the same pointer under the place the schema now sits (``at``);
- ``$schema`` / ``$id`` of the embedded root are dropped (a base URI would change what the
  rewritten references mean). Anchors (``#name``) and remote references are left as they are
  (the normalizer refuses remote ones, naming them).

References follow JSON Schema 2020-12 section 8.2.3 and RFC 6901 (JSON Pointer escaping).
"""
from __future__ import annotations

import copy
from typing import Any
from urllib.parse import quote, unquote

_DEF_KEYS = ("$defs", "definitions")
# Keys whose values are data, not schemas: a "$ref" string inside them is not a reference.
_DATA_KEYS = frozenset({"const", "enum", "default", "examples", "example"})


def _unescape(segment: str) -> str:
    return unquote(segment).replace("~1", "/").replace("~0", "~")


def _escape(segment: str) -> str:
    return quote(segment.replace("~", "~0").replace("/", "~1"), safe="~!$&'()*+,;=:@")


def rewrite_ref(ref: str, at: str, renamed: dict[tuple[str, str], str]) -> str:
    """The reference ``ref`` (written against the embedded schema's root) rewritten against the
    new root, where the schema sits at JSON pointer ``at`` and its definitions were renamed as
    ``renamed[(defs_key, name)] -> new name`` under ``/$defs``."""
    if not ref.startswith("#"):
        return ref  # remote: refused later by the normalizer, with its name
    pointer = ref[1:]
    if pointer and not pointer.startswith("/"):
        return ref  # an anchor: anchors are document-wide, still found
    parts = pointer.split("/")[1:] if pointer else []
    if len(parts) >= 2 and parts[0] in _DEF_KEYS:
        new = renamed.get((parts[0], _unescape(parts[1])))
        if new is not None:
            return "#/$defs/" + "/".join([_escape(new)] + parts[2:])
    return "#" + at + pointer


def _rewrite(node: Any, at: str, renamed: dict[tuple[str, str], str]) -> Any:
    if isinstance(node, dict):
        out = {}
        for k, v in node.items():
            if k == "$ref" and isinstance(v, str):
                out[k] = rewrite_ref(v, at, renamed)
            elif k in _DATA_KEYS:
                out[k] = v
            else:
                out[k] = _rewrite(v, at, renamed)
        return out
    if isinstance(node, list):
        return [_rewrite(v, at, renamed) for v in node]
    return node


def embed_schema(schema: Any, at: str, defs: dict[str, Any], prefix: str) -> Any:
    """The copy of ``schema`` to place at JSON pointer ``at`` of a wrapper schema.

    Args:
        schema: the user's schema (a dict or a boolean); not modified.
        at: where the copy will sit in the wrapper, as a JSON pointer (``/properties/arguments``).
        defs: the wrapper's root ``$defs``; the schema's definitions are added to it as
            ``prefix + name`` (a numbered suffix avoids a name already there).
        prefix: a prefix unique to this embedded schema within the wrapper (``t0_``).

    Returns:
        The schema without ``$defs`` / ``definitions`` / ``$schema`` / ``$id`` at its root and
        with every local ``$ref`` pointing into the wrapper.
    """
    if not isinstance(schema, dict):
        return schema
    renamed: dict[tuple[str, str], str] = {}
    for key in _DEF_KEYS:
        table = schema.get(key)
        if not isinstance(table, dict):
            continue
        for name in table:
            new, n = prefix + name, 1
            while new in defs or new in renamed.values():
                n += 1
                new = f"{prefix}{name}_{n}"
            renamed[(key, name)] = new
    body = {k: v for k, v in schema.items() if k not in _DEF_KEYS and k not in ("$schema", "$id")}
    out = _rewrite(copy.deepcopy(body), at, renamed)
    for (key, name), new in renamed.items():
        defs[new] = _rewrite(copy.deepcopy(schema[key][name]), at, renamed)
    return out

