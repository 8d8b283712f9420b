"""The shared vocabulary of the JSON Schema normalizer (:mod:`sgrt.constrained.schema`): the
keyword sets it sorts keywords by, and the marks it sets on nodes it narrowed or on schemas whose
keys must keep one spelling, with the helpers that read and drop them."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sgrt.constrained.numbers import is_number
from sgrt.constrained.schema_algebra import Schema, map_subschemas, subschemas

_ANNOTATIONS = {
    "title", "description", "default", "examples", "$comment", "deprecated", "readOnly",
    "writeOnly", "$schema", "$id", "id", "$anchor", "$dynamicAnchor", "$vocabulary",
    "contentMediaType", "contentEncoding", "contentSchema", "nullable", "discriminator", "xml",
    "externalDocs", "example", "x-guidance",
}
# Keywords that no backend can enforce and that we do not rewrite: fail closed.
_UNSUPPORTED = {
    "$dynamicRef": "dynamic references",
    "$recursiveRef": "recursive references",
}
_ROOT_BASE = "https://sgrt.invalid/root.json"  # base URI of a document without a root $id
# ``minContains`` above this is refused: the sound subset spells that many items out.
MAX_MIN_CONTAINS = 64
_COUNT_KEYS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties",
               "minContains", "maxContains")
_OLD_DRAFTS = ("draft-03", "draft-04", "draft-06", "draft-07")
_APPLICATORS = ("allOf", "anyOf", "oneOf")
_OBJECT_KEYS = ("properties", "patternProperties", "additionalProperties", "required",
                "propertyNames", "minProperties", "maxProperties", "dependentRequired",
                "dependentSchemas", "dependencies", "unevaluatedProperties")


# Set on a normalized schema (llguidance only) when some object lets free keys sit beside named
# or pattern-matched ones. llguidance lexes free keys with the general JSON string lexeme (any
# escape) and tells them apart from the named keys by their *raw* text, so ``"\u0066oo"`` would
# be a free key whose value escapes ``properties.foo``'s schema. With this key the backend turns
# off ``\uXXXX`` escapes for the whole schema: every key then has exactly one spelling (``\/``
# is never accepted), so raw and decoded comparisons agree. The backend pops the key.
PLAIN_ESCAPES_KEY = "x-sgrt-plain-escapes"

# Set, while normalizing, on a node that we made narrower than the user wrote it: a list of the
# keys we added (``additionalProperties: false`` of a closed object, the default string cap), or
# ``True`` on a whole ``allOf`` member that only narrows (an ``unevaluated*`` rewrite, the
# ``contains`` subset). Narrowing a positive position is sound; negating a narrowed schema is not
# (``not: {$ref: string}`` must not accept long strings because the target got a cap), so every
# negation and disjointness proof works on :func:`relax`'s view, which drops what we added. The
# key never leaves this module.
NARROWED_KEY = "x-sgrt-narrowed"


def relax(node: Schema) -> Schema:
    """``node`` without the narrowing we added (see :data:`NARROWED_KEY`): the user's schema, or a
    wider one where a narrowing member stood (that member becomes ``true``). Negating the relaxed
    view gives a subset of the true complement, so a negation in a positive position stays sound."""
    if not isinstance(node, dict):
        return node
    mark = node.get(NARROWED_KEY)
    if mark is True:
        return True
    if mark is not None:
        node = {k: v for k, v in node.items() if k != NARROWED_KEY and k not in mark}
    return map_subschemas(node, lambda sub, _p: relax(sub), "")


def strip_marks(node: Schema) -> Schema:
    """``node`` with every :data:`NARROWED_KEY` removed (what the backends see)."""
    if not isinstance(node, dict):
        return node
    node = {k: v for k, v in node.items() if k != NARROWED_KEY}
    return map_subschemas(node, lambda sub, _p: strip_marks(sub), "")


def _narrowed_member(node: Schema) -> bool:
    """Whether ``node`` holds a whole-member narrowing (``NARROWED_KEY: true``) anywhere."""
    if not isinstance(node, dict):
        return False
    return node.get(NARROWED_KEY) is True or any(_narrowed_member(sub) for _, sub in subschemas(node))


def _mark_narrowed(node: dict, key: str) -> None:
    node[NARROWED_KEY] = list(node.get(NARROWED_KEY) or []) + [key]


def mixes_named_and_free_keys(tree: Schema) -> bool:
    """Whether any object schema in ``tree`` allows keys it does not name (``additionalProperties``
    not ``false``, or absent) next to ``properties`` or ``patternProperties``: the objects where
    an escaped spelling of a named key could be taken for a free key."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict):
            continue
        if (node.get("properties") or node.get("patternProperties")) and node.get("additionalProperties", True) is not False:
            return True
        stack.extend(sub for _, sub in subschemas(node))
    return False


def _spell_node(node: dict) -> dict:
    """``node``'s ``const`` / ``enum`` objects, which llguidance would match only as one literal
    text, rewritten (llguidance only, in the normalizer's last walk, node by node) into
    ``properties`` of the members' values, all ``required``, closed: an instance lists the keys
    in the grammar's order (as for every object), whatever order the schema wrote them in.
    Other values stay literals (an integral number is written without a fraction: ``1``, not
    ``1.0``; a departure)."""
    values = [node["const"]] if "const" in node else node.get("enum") if isinstance(node.get("enum"), list) else None
    if values is None or not any(_needs_spelling(v) for v in values):
        return node
    literal = [v for v in values if not _needs_spelling(v)]
    branches = ([{"enum": literal}] if literal else []) + [_value_schema(v) for v in values if _needs_spelling(v)]
    node = {k: v for k, v in node.items() if k not in ("const", "enum")}
    node["allOf"] = list(node.get("allOf") or []) + [branches[0] if len(branches) == 1 else {"anyOf": branches}]
    return node


def _needs_spelling(v: Any) -> bool:
    if isinstance(v, dict):
        return True
    if isinstance(v, list):
        return any(_needs_spelling(x) for x in v)
    return False


def _value_schema(v: Any) -> Schema:
    if isinstance(v, dict):
        return {"type": "object", "properties": {k: _value_schema(x) for k, x in v.items()},
                "required": list(v), "additionalProperties": False}
    if isinstance(v, list):
        return {"type": "array", "prefixItems": [_value_schema(x) for x in v], "items": False, "minItems": len(v)}
    return {"const": v}


@dataclass(frozen=True)
class _Evaluated:
    """Members of an instance a schema evaluates for sure: property names and patterns (or a
    count of leading items), or all of them."""

    names: tuple = ()  # ordered as the schema lists them (the grammar's key order follows)
    patterns: tuple = ()
    items: int = 0
    all: bool = False

    def __or__(self, other: "_Evaluated") -> "_Evaluated":
        return _Evaluated(tuple(dict.fromkeys(self.names + other.names)),
                          tuple(dict.fromkeys(self.patterns + other.patterns)),
                          max(self.items, other.items), self.all or other.all)

    def __and__(self, other: "_Evaluated") -> "_Evaluated":
        if self.all or other.all:
            return other if self.all else self
        return _Evaluated(tuple(n for n in self.names if n in other.names),
                          tuple(p for p in self.patterns if p in other.patterns), min(self.items, other.items))


def _is_num(v: Any) -> bool:
    return is_number(v)
