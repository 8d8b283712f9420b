"""Refuse a JSON Schema that no finite JSON value satisfies, before it is compiled.

``{"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}`` asks for an
object that must contain itself: it has no finite instance. llguidance compiles it without
complaint; its lexer-level mask then allows the first token (``{"``) and consuming it sends the
Earley parser down the endless chain of forced ``{"a":`` prefixes until it hits its item limit,
so the request died with "grammar rejected token N that its mask allowed". The cause is an empty
language, so the fix is to find it at compile time: the least fixpoint of "has a finite
instance" over the schema's nodes, following local ``$ref`` (the standard productivity analysis
of context-free grammars, applied to schema keywords). It is conservative: a keyword it does not
model counts as satisfiable, so it never refuses a schema that has an instance.
"""
from __future__ import annotations

from typing import Any

from sgrt.constrained.limits import _resolve
from sgrt.errors import GrammarError

_MAX_SWEEPS = 256  # past this (a pathological graph), give up and accept: conservative


def check_satisfiable(schema: Any) -> None:
    """Raise if ``schema`` (a normalized schema: dict or bool) has no finite instance.

    Raises:
        GrammarError: (field ``json_schema``) the schema, or a ``$ref`` chain it requires, can
            only be satisfied by an infinitely deep value.
    """
    if not isinstance(schema, dict):
        return
    nodes = _dict_nodes(schema)
    ok: dict[int, bool] = {id(n): False for n in nodes}
    for _ in range(_MAX_SWEEPS):
        changed = False
        for node in nodes:
            if not ok[id(node)] and _productive(node, schema, ok):
                ok[id(node)] = True
                changed = True
        if not changed:
            break
    else:
        return
    if not ok[id(schema)]:
        raise GrammarError(
            "json_schema has no finite instance: every value it allows would have to contain itself "
            "without end (a required property, a minItems item or an allOf member recurses back "
            "through $ref with no way out); make the recursive part optional or add a base case",
            field="json_schema", path="",
        )


def _dict_nodes(root: dict) -> list[dict]:
    """Every dict in the document, children before parents (fewer sweeps to the fixpoint)."""
    order: list[dict] = []
    seen: set[int] = set()
    stack: list[Any] = [root]
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, dict):
            order.append(node)
            stack.extend(v for v in node.values() if isinstance(v, (dict, list)))
        elif isinstance(node, list):
            stack.extend(v for v in node if isinstance(v, (dict, list)))
    order.reverse()
    return order


def _sub(value: Any, root: dict, ok: dict[int, bool]) -> bool:
    """Whether a subschema value is known to have an instance (under the current assumption)."""
    if value is False:
        return False
    if isinstance(value, dict):
        return ok.get(id(value), True)
    return True


def _productive(node: dict, root: dict, ok: dict[int, bool]) -> bool:
    ref = node.get("$ref")
    if isinstance(ref, str):
        target = _resolve(root, ref)
        if target is False or (isinstance(target, dict) and not ok.get(id(target), True)):
            return False
    all_of = node.get("allOf")
    if isinstance(all_of, list) and not all(_sub(s, root, ok) for s in all_of):
        return False
    for key in ("anyOf", "oneOf"):
        branches = node.get(key)
        if isinstance(branches, list) and not any(_sub(s, root, ok) for s in branches):
            return False
    if "enum" in node or "const" in node:
        return True
    types = node.get("type")
    if types is None:
        return True  # no type: a scalar instance is allowed
    types = [types] if isinstance(types, str) else types
    if not isinstance(types, list):
        return True
    return any(_type_productive(t, node, root, ok) for t in types)


def _type_productive(kind: Any, node: dict, root: dict, ok: dict[int, bool]) -> bool:
    if kind == "object":
        props = node.get("properties") if isinstance(node.get("properties"), dict) else {}
        required = node.get("required") if isinstance(node.get("required"), list) else []
        return all(_sub(props[name], root, ok) for name in required if isinstance(name, str) and name in props)
    if kind == "array":
        min_items = node.get("minItems", 0)
        if not isinstance(min_items, int) or min_items <= 0:
            return True
        prefix = node.get("prefixItems") if isinstance(node.get("prefixItems"), list) else []
        for i in range(min(min_items, len(prefix))):
            if not _sub(prefix[i], root, ok):
                return False
        if min_items > len(prefix):
            items = node.get("items")
            if items is not None and not isinstance(items, list) and not _sub(items, root, ok):
                return False
        return True
    return True
