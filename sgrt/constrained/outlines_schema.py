"""Make a normalized JSON Schema safe for outlines-core's schema-to-regex, or refuse it.

outlines-core 0.2.14 (``src/json_schema/parsing.rs``) builds its regex from the *first* keyword
it recognizes in each subschema, in a fixed order (``properties``, ``allOf``, ``anyOf``,
``oneOf``, ``prefixItems``, ``enum``, ``const``, ``$ref``, ``type``), and silently drops the
rest. It also: treats ``allOf`` as concatenation and ``oneOf`` as ``anyOf``; ignores numeric
bounds, ``pattern`` / ``format`` once a length bound is present, and ``required`` without
``properties``; pastes ``pattern`` unescaped with a full-match reading; cuts recursive ``$ref``
at depth 3 by dropping the property (even a required one); rejects ``1e5`` (exponent sign
mandatory). Each of these gives wrong answers, so :func:`prepare` accepts only subschemas
whose every constraining keyword outlines-core honours, rewrites what can be rewritten exactly
(formats and patterns into JSON-safe full-match regexes, provably exclusive ``oneOf`` into
``anyOf``, boolean subschemas), and raises :class:`~sgrt.errors.GrammarError` naming the keyword
and path otherwise. The regex it then produces is patched by :func:`patch_regex` (numbers,
string escapes).

What remains is sound (never accepts an invalid instance) but can be incomplete: objects are
always closed, arrays without ``items`` and empty schemas allow only two levels of nesting.
"""
from __future__ import annotations

import re
from typing import Any

from outlines_core import json_schema as oc_json

from sgrt.constrained.ecma_regex import search as ecma_search
from sgrt.constrained.formats import FORMAT_REGEXES
from sgrt.constrained.patterns import UnsupportedPattern, pattern_to_json_string_regex
from sgrt.constrained.schema_algebra import VALIDATION_KEYWORDS, provably_disjoint, type_set
from sgrt.errors import GrammarError

_DISPATCH = ("properties", "allOf", "anyOf", "oneOf", "prefixItems", "enum", "const", "$ref", "type")
_TYPE_KEYS = {
    "string": {"minLength", "maxLength", "pattern", "format"},
    "number": set(),
    "integer": set(),
    "array": {"items", "minItems", "maxItems"},
    "object": {"additionalProperties", "minProperties", "maxProperties"},
    "boolean": set(),
    "null": set(),
}
_NOT_SAFE_KEY = re.compile(r'["\\\x00-\x1f\x7f-\x9f]')

# RFC 8259 numbers (outlines-core's NUMBER makes the exponent sign mandatory).
NUMBER = r"(?:-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?)"
# String characters plus \uXXXX escapes other than surrogates (a surrogate pair would count as
# two characters against minLength / maxLength while JSON Schema counts one).
STRING_INNER_UNICODE = (
    r'(?:[^"\\\x00-\x1F\x7F-\x9F]|\\["\\/bfnrt]|\\u(?:[0-9a-cA-Ce-fE-F][0-9a-fA-F]{3}|[dD][0-7][0-9a-fA-F]{2}))'
)


def prepare(root: Any) -> Any:
    """Return an equivalent schema outlines-core translates correctly, or raise GrammarError."""
    if root is True:
        return {}
    p = _Preparer(root)
    p.check_no_cycles()
    return p.prep(root, "")


def patch_regex(regex: str, unicode_escapes: bool) -> str:
    """Replace outlines-core's number and string-character regexes with correct ones."""
    regex = regex.replace(oc_json.NUMBER, NUMBER)
    if unicode_escapes:
        regex = regex.replace(oc_json.STRING_INNER, STRING_INNER_UNICODE)
    return regex


def bounded_repetitions(regex: str) -> int:
    """Sum of the upper bounds of ``{m,n}`` repetitions: a proxy for the DFA's size."""
    found = re.finditer(r"(?<![xu])\{(\d+)(?:,(\d*))?\}", regex)
    return sum(int(m.group(2) or m.group(1)) for m in found)


def _refuse(keyword: str, path: str, why: str) -> GrammarError:
    return GrammarError(
        f"json_schema keyword {keyword!r} at {path or '/'} is not supported by the outlines backend: {why} "
        "(the llguidance backend supports it)",
        field="json_schema",
        path=f"{path}/{keyword}",
    )


class _Preparer:
    def __init__(self, root: Any):
        self.root = root

    def resolve(self, ref: str) -> Any:
        node = self.root
        for part in ref.lstrip("#").split("/")[1:]:
            node = node[part]
        return node

    def check_no_cycles(self) -> None:
        """Refuse recursive schemas: outlines-core cuts them at depth 3 by dropping properties."""

        def refs_in(node: Any) -> set[str]:
            found: set[str] = set()
            stack = [node]
            while stack:
                x = stack.pop()
                if isinstance(x, dict):
                    if isinstance(x.get("$ref"), str):
                        found.add(x["$ref"].split("#", 1)[-1])
                    stack.extend(v for k, v in x.items() if k not in ("$defs", "definitions"))
                elif isinstance(x, list):
                    stack.extend(x)
            return found

        state: dict[str, int] = {}  # 1 = on the stack, 2 = done

        def visit(pointer: str) -> None:
            if state.get(pointer) == 2:
                return
            if state.get(pointer) == 1:
                raise _refuse("$ref", pointer, "recursive schemas are cut at depth 3 by outlines-core, dropping properties")
            state[pointer] = 1
            try:
                target = self.resolve("#" + pointer)
            except (KeyError, IndexError, TypeError):
                raise _refuse("$ref", pointer, "the reference does not resolve") from None
            for ref in refs_in(target):
                visit(ref)
            state[pointer] = 2

        for ref in refs_in(self.root):
            visit(ref)

    def prep(self, node: Any, path: str) -> Any:
        if node is True:
            return {}
        if node is False:
            raise _refuse("false", path, "a `false` subschema here cannot be expressed")
        if not isinstance(node, dict):
            raise GrammarError(f"subschema at {path or '/'} must be an object or a boolean", field="json_schema", path=path)
        defs = {k: node[k] for k in ("$defs", "definitions") if isinstance(node.get(k), dict)}
        keys = {k: v for k, v in node.items() if k in VALIDATION_KEYWORDS}
        out: dict[str, Any] = {}
        for k, v in defs.items():
            out[k] = {name: self.prep(sub, f"{path}/{k}/{name}") for name, sub in v.items()}
        if not keys:
            return out or {}
        dispatch = next((k for k in _DISPATCH if k in keys), None)
        if dispatch is None:
            raise _refuse(sorted(keys)[0], path, "outlines-core ignores it")
        handler = getattr(self, "_" + dispatch.lstrip("$"))
        out.update(handler(keys, path))
        return out

    # ---- per dispatch keyword ---------------------------------------------------------------

    def _only(self, keys: dict, allowed: set[str], path: str, dispatch: str) -> None:
        for k in keys:
            if k != dispatch and k not in allowed:
                raise _refuse(k, path, f"outlines-core ignores it next to {dispatch!r}")

    def _properties(self, keys: dict, path: str) -> dict:
        self._only(keys, {"type", "required", "additionalProperties", "patternProperties", "minProperties", "maxProperties"}, path, "properties")
        if "type" in keys and "object" not in type_set({"type": keys["type"]}):
            raise _refuse("type", path, "'properties' next to a non-object type")
        props: dict[str, Any] = {}
        required = list(keys.get("required") or [])
        for name, sub in keys["properties"].items():
            if _NOT_SAFE_KEY.search(name):
                raise _refuse("properties", path, f"key {name!r} needs JSON escaping")
            if sub is False:
                if name in required:
                    raise _refuse("required", path, f"required key {name!r} is forbidden (`false`)")
                continue
            props[name] = self.prep(sub, f"{path}/properties/{name}")
        for pattern in keys.get("patternProperties") or {}:
            # Closed objects make patternProperties moot for extra keys, but a pattern also
            # constrains the listed keys it matches, which outlines-core would not check.
            try:
                hits = [name for name in props if ecma_search(pattern, name)]
            except UnsupportedPattern:
                hits = list(props)
            if hits:
                raise _refuse("patternProperties", path, f"it also constrains listed keys {hits[:3]}")
        missing = [r for r in required if r not in props]
        if missing:
            raise _refuse("required", path, f"required keys {missing} are not in 'properties' (objects are closed)")
        if keys.get("minProperties", 0) > len(required):
            raise _refuse("minProperties", path, "it could be violated by omitting optional keys")
        if "maxProperties" in keys and keys["maxProperties"] < len(props):
            raise _refuse("maxProperties", path, "it could be violated by including optional keys")
        out: dict[str, Any] = {"properties": props}
        if required:
            out["required"] = required
        return out

    def _allOf(self, keys: dict, path: str) -> dict:
        branches = keys["allOf"]
        self._only(keys, set(), path, "allOf")
        if len(branches) != 1:
            raise _refuse("allOf", path, "outlines-core concatenates allOf branches instead of intersecting them")
        return self._wrap(self.prep(branches[0], f"{path}/allOf/0"))

    def _anyOf(self, keys: dict, path: str, name: str = "anyOf") -> dict:
        branches = keys[name]
        allowed = {"type"} if "type" in keys else set()
        self._only(keys, allowed, path, name)
        if "type" in keys:
            parent = type_set({"type": keys["type"]})
            for i, b in enumerate(branches):
                bt = type_set(b) if b is not False else set()
                if bt is None or not bt <= parent | ({"integer"} if "number" in parent else set()):
                    raise _refuse("type", path, f"outlines-core ignores 'type' next to {name!r}")
        kept = [self.prep(b, f"{path}/{name}/{i}") for i, b in enumerate(branches) if b is not False]
        if not kept:
            raise _refuse(name, path, "no branch can match")
        return {"anyOf": kept}

    def _oneOf(self, keys: dict, path: str) -> dict:
        branches = keys["oneOf"]
        for i in range(len(branches)):
            for j in range(i + 1, len(branches)):
                if not provably_disjoint(branches[i], branches[j], self.resolve):
                    raise _refuse("oneOf", path, f"branches {i} and {j} may overlap and outlines-core treats oneOf as anyOf")
        return self._anyOf(keys, path, "oneOf")

    def _prefixItems(self, keys: dict, path: str) -> dict:
        self._only(keys, {"type", "items", "minItems", "maxItems"}, path, "prefixItems")
        items = keys["prefixItems"]
        if keys.get("minItems", 0) > len(items):
            raise _refuse("minItems", path, "outlines-core generates exactly the prefixItems")
        if keys.get("maxItems", len(items)) < len(items):
            raise _refuse("maxItems", path, "outlines-core generates all the prefixItems")
        if not items:
            return {"type": "array", "maxItems": 0}
        return {"prefixItems": [self.prep(s, f"{path}/prefixItems/{i}") for i, s in enumerate(items)]}

    def _enum(self, keys: dict, path: str, name: str = "enum") -> dict:
        self._only(keys, {"type"}, path, name)
        values = keys[name] if name == "enum" else [keys[name]]
        if not isinstance(values, list) or not values:
            raise _refuse(name, path, "it must be a non-empty list")
        if "type" in keys:
            allowed = type_set({"type": keys["type"]})
            values = [v for v in values if type_set({"const": v}) & (allowed | ({"integer"} if "number" in allowed else set()))]
            if not values:
                raise _refuse(name, path, "no value matches 'type'")
        for v in values:
            if isinstance(v, (dict, list)):
                raise _refuse(name, path, "object and array values are not supported by outlines-core")
        return {"enum": values}

    def _const(self, keys: dict, path: str) -> dict:
        return self._enum(keys, path, "const")

    def _ref(self, keys: dict, path: str) -> dict:
        self._only(keys, set(), path, "$ref")
        ref = keys["$ref"]
        if not isinstance(ref, str) or not ref.startswith("#/") or "~" in ref or "%" in ref:
            raise _refuse("$ref", path, "only plain local references ('#/$defs/name') are supported")
        return {"$ref": ref}

    def _type(self, keys: dict, path: str) -> dict:
        t = keys["type"]
        types = [t] if isinstance(t, str) else list(t)
        if not types:
            raise _refuse("type", path, "empty type list")
        allowed = set().union(*(_TYPE_KEYS[x] for x in types))
        self._only(keys, allowed, path, "type")
        out: dict[str, Any] = {"type": t}
        if "string" in types:
            out.update(self._string(keys, path))
        if "array" in types:
            out.update(self._array(keys, path))
        if "object" in types:
            out.update(self._object(keys, path))
        return out

    def _string(self, keys: dict, path: str) -> dict:
        lengths = {k: keys[k] for k in ("minLength", "maxLength") if k in keys}
        pattern = keys.get("pattern")
        fmt = keys.get("format")
        if pattern is not None and fmt is not None:
            raise _refuse("format", path, "'format' together with 'pattern'")
        if lengths and (pattern is not None or fmt is not None):
            raise _refuse("pattern" if pattern is not None else "format", path,
                          "outlines-core ignores it when minLength / maxLength is set")
        if fmt is not None:
            if fmt not in FORMAT_REGEXES:
                raise _refuse("format", path, f"unknown format {fmt!r}")
            return {"pattern": f"^{FORMAT_REGEXES[fmt]}$"}
        if pattern is not None:
            try:
                return {"pattern": "^" + pattern_to_json_string_regex(pattern) + "$"}
            except (UnsupportedPattern, ValueError) as e:
                raise _refuse("pattern", path, str(e)) from e
        return lengths

    def _array(self, keys: dict, path: str) -> dict:
        out = {k: keys[k] for k in ("minItems", "maxItems") if k in keys}
        items = keys.get("items")
        if items is False:
            if out.get("minItems", 0) > 0:
                raise _refuse("minItems", path, "no item is allowed")
            return {"maxItems": 0}
        if items is not None:
            out["items"] = self.prep(items, f"{path}/items")
        return out

    def _object(self, keys: dict, path: str) -> dict:
        out = {k: keys[k] for k in ("minProperties", "maxProperties") if k in keys}
        extra = keys.get("additionalProperties")
        if extra is False:
            if out.get("minProperties", 0) > 0:
                raise _refuse("minProperties", path, "no key is allowed")
            return {"maxProperties": 0}
        if isinstance(extra, dict):
            out["additionalProperties"] = self.prep(extra, f"{path}/additionalProperties")
        return out

    @staticmethod
    def _wrap(node: Any) -> dict:
        return node if isinstance(node, dict) else {}
