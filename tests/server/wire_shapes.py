"""Schema-shaped wrong types for the HTTP routes' request bodies (imported by the hardening
tests): every place of a valid body, with the JSON types its wire struct allows there (read
from msgspec's JSON Schema of that struct), and a value of a JSON type it does not allow."""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import msgspec

#: One value of each JSON type (0.5: a number that no integer field takes).
SAMPLES: dict[str, Any] = {"null": None, "boolean": True, "integer": 7, "number": 0.5, "string": "x",
                           "array": [1], "object": {"k": 1}}
Path = tuple[str | int, ...]


def json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


class Shapes:
    """The JSON Schema of a wire struct (``msgspec.json.schema``), walked beside a value."""

    def __init__(self, kind: Any):
        schema = msgspec.json.schema(kind)
        self.defs = schema.get("$defs", {})
        self.root = schema

    def resolve(self, node: Any) -> Any:
        while isinstance(node, dict) and "$ref" in node:
            node = self.defs[node["$ref"].rsplit("/", 1)[1]]
        return node

    def allowed(self, node: Any) -> set[str] | None:
        """JSON types ``node`` allows (None: any)."""
        node = self.resolve(node)
        if not isinstance(node, dict):
            return None
        if "anyOf" in node:
            out: set[str] = set()
            for branch in node["anyOf"]:
                kinds = self.allowed(branch)
                if kinds is None:
                    return None
                out |= kinds
            return out
        if "const" in node or "enum" in node:
            return {json_type(v) for v in node.get("enum", [node.get("const")])}
        kind = node.get("type")
        if kind is None:
            return None
        kinds = set(kind) if isinstance(kind, list) else {kind}
        if "number" in kinds:
            kinds.add("integer")
        return kinds

    def branch(self, node: Any, value: Any) -> Any:
        """The branch of ``node`` (an ``anyOf``) that ``value`` takes."""
        node = self.resolve(node)
        if isinstance(node, dict) and "anyOf" in node:
            for b in node["anyOf"]:
                kinds = self.allowed(b)
                if kinds is None or json_type(value) in kinds:
                    return self.resolve(b)
        return node

    def child(self, node: Any, key: str | int, value: Any) -> Any:
        node = self.branch(node, value)
        if not isinstance(node, dict):
            return None
        if isinstance(key, int):
            if "prefixItems" in node and key < len(node["prefixItems"]):
                return node["prefixItems"][key]
            return node.get("items")
        props = node.get("properties", {})
        if key in props:
            return props[key]
        extra = node.get("additionalProperties")
        return extra if isinstance(extra, dict) else None


def wrong_values(shapes: Shapes, body: Any, overrides: dict[Path, Shapes] | None = None) -> Iterator[tuple[Path, Any]]:
    """``(path, value)`` for every place of ``body`` whose schema constrains its type, with a
    value of each JSON type the schema does not allow there. ``overrides`` gives the struct of a
    place that the request's own schema leaves open (a Responses input item is a free object
    there and gets its type's struct when converted)."""
    overrides = overrides or {}

    def walk(node: Any, value: Any, path: Path, sh: Shapes) -> Iterator[tuple[Path, Any]]:
        pattern = tuple("*" if isinstance(p, int) else p for p in path)
        if pattern in overrides:
            sh = overrides[pattern]
            node = sh.root
        kinds = sh.allowed(node) if node is not None else None
        if kinds is None:
            return
        for kind, sample in SAMPLES.items():
            if kind not in kinds:
                yield path, sample
        if isinstance(value, dict):
            for k, v in value.items():
                yield from walk(sh.child(node, k, value), v, path + (k,), sh)
        elif isinstance(value, list):
            for i, v in enumerate(value):
                yield from walk(sh.child(node, i, value), v, path + (i,), sh)

    yield from walk(shapes.root, body, (), shapes)


def replaced(body: Any, path: Path, value: Any) -> Any:
    """A deep copy of ``body`` with the value at ``path`` replaced."""
    out = msgspec.json.decode(msgspec.json.encode(body))
    if not path:
        return value
    target = out
    for p in path[:-1]:
        target = target[p]
    target[path[-1]] = value
    return out
