"""Schema algebra used by :mod:`sgrt.constrained.schema`: walking subschemas, type sets,
exact negation (so ``not`` / ``if`` / ``oneOf`` can be rewritten into what grammar backends
support), a sound disjointness check, and the complement of a finite set of strings as a regex.
"""
from __future__ import annotations

from typing import Any, Callable, Iterator
from urllib.parse import unquote

from sgrt.constrained.numbers import exact, is_integral, is_number

Schema = Any  # dict | bool

ALL_TYPES = ("null", "boolean", "object", "array", "number", "string")
TYPES = set(ALL_TYPES) | {"integer"}
# Keywords whose values are maps of subschemas, single subschemas, or lists of subschemas.
_MAP_KEYS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_ONE_KEYS = (
    "additionalProperties", "items", "not", "if", "then", "else", "contains", "propertyNames",
    "unevaluatedItems", "unevaluatedProperties", "additionalItems",
)
_LIST_KEYS = ("allOf", "anyOf", "oneOf", "prefixItems")

# ---------------------------------------------------------------------------------------------
# Tree helpers


# Every key that holds subschemas, in the order the walks visit them (maps, single schemas,
# lists, then ``dependencies``), and its kind.
_SUB_ORDER = {k: i for i, k in enumerate(_MAP_KEYS + _ONE_KEYS + _LIST_KEYS + ("dependencies",))}
_SUB_KEYS = frozenset(_SUB_ORDER)


def _present(node: dict) -> list[str]:
    """The subschema keys of ``node`` in visiting order (most nodes have none or one, so the
    walks look at those instead of every keyword name)."""
    present = node.keys() & _SUB_KEYS
    return sorted(present, key=_SUB_ORDER.__getitem__) if len(present) > 1 else list(present)


def subschemas(node: Schema) -> Iterator[tuple[str, Schema]]:
    """(relative JSON pointer, subschema) for every direct subschema of ``node``."""
    if not isinstance(node, dict):
        return
    for k in _present(node):
        v = node[k]
        if k in _MAP_KEYS or k == "dependencies":
            if isinstance(v, dict):
                for name, sub in v.items():
                    if k != "dependencies" or isinstance(sub, (dict, bool)):
                        yield f"/{k}/{escape_pointer(name)}", sub
        elif isinstance(v, list):
            if k in _LIST_KEYS or k == "items":
                for i, sub in enumerate(v):
                    yield f"/{k}/{i}", sub
        elif isinstance(v, (dict, bool)) and k in _ONE_KEYS:
            yield f"/{k}", v


def map_subschemas(node: dict, fn: Callable[[Schema, str], Schema], path: str) -> dict:
    """A shallow copy of ``node`` with every direct subschema replaced by ``fn(sub, sub_path)``."""
    out = dict(node)
    for k in _present(node):
        v = node[k]
        if k in _MAP_KEYS:
            if isinstance(v, dict):
                out[k] = {name: fn(sub, f"{path}/{k}/{escape_pointer(name)}") for name, sub in v.items()}
        elif k == "dependencies":
            if isinstance(v, dict):
                out[k] = {
                    name: fn(sub, f"{path}/dependencies/{escape_pointer(name)}") if isinstance(sub, (dict, bool)) else sub
                    for name, sub in v.items()
                }
        elif isinstance(v, list):
            if k in _LIST_KEYS or k == "items":
                out[k] = [fn(sub, f"{path}/{k}/{i}") for i, sub in enumerate(v)]
        elif isinstance(v, (dict, bool)) and k in _ONE_KEYS:
            out[k] = fn(v, f"{path}/{k}")
    return out


def escape_pointer(name: str) -> str:
    return name.replace("~", "~0").replace("/", "~1")


def unescape_pointer(part: str) -> str:
    return unquote(part).replace("~1", "/").replace("~0", "~")


def declares_keys(node: dict) -> bool:
    return bool(node.get("properties") or node.get("patternProperties")) or isinstance(
        node.get("additionalProperties"), dict
    )


# Keywords that constrain instances (JSON Schema 2020-12 and older drafts); anything else is an
# annotation or an unknown keyword, which 2020-12 says to ignore.
VALIDATION_KEYWORDS = frozenset({
    "type", "enum", "const", "properties", "required", "additionalProperties", "patternProperties",
    "propertyNames", "minProperties", "maxProperties", "items", "prefixItems", "additionalItems",
    "minItems", "maxItems", "uniqueItems", "contains", "minContains", "maxContains", "minLength",
    "maxLength", "pattern", "format", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
    "multipleOf", "allOf", "anyOf", "oneOf", "not", "if", "then", "else", "$ref", "$dynamicRef",
    "$recursiveRef", "dependentRequired", "dependentSchemas", "dependencies", "unevaluatedItems",
    "unevaluatedProperties",
})


def constraining_keys(node: dict) -> set[str]:
    return {k for k in node if k in VALIDATION_KEYWORDS}


def type_set(node: Schema) -> set[str] | None:
    """The JSON types ``node`` allows, from ``type`` / ``const`` / ``enum`` (None: any type).

    ``"integer"`` is kept apart from ``"number"``; a ``"number"`` set includes integers.
    """
    if node is False:
        return set()
    if not isinstance(node, dict):
        return None
    result: set[str] | None = None
    t = node.get("type")
    if isinstance(t, str):
        result = {t}
    elif isinstance(t, list):
        result = set(t)
    values = None
    if "const" in node:
        values = [node["const"]]
    elif isinstance(node.get("enum"), list):
        values = node["enum"]
    if values is not None:
        vt = {_value_type(v) for v in values}
        result = vt if result is None else _intersect_types(result, vt)
    return result


def _value_type(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if is_number(v):
        return "integer" if is_integral(v) else "number"
    if isinstance(v, str):
        return "string"
    return "array" if isinstance(v, list) else "object"


def _intersect_types(a: set[str], b: set[str]) -> set[str]:
    out = a & b
    if "number" in a and "integer" in b or "integer" in a and "number" in b:
        out.add("integer")
    return out


def _types_disjoint(a: set[str] | None, b: set[str] | None) -> bool:
    return a is not None and b is not None and not _intersect_types(a, b)


# ---------------------------------------------------------------------------------------------
# Negation and exclusivity (exact rewrites only; anything else raises Inexpressible)


class Inexpressible(Exception):
    pass


def negate(node: Schema, resolve: Callable[[str], Schema], depth: int = 0,
           context: set[str] | None = None) -> Schema:
    """A schema accepting exactly the instances ``node`` rejects, without using ``not``.

    Handles boolean schemas, ``type``, ``required``, ``properties``, ``prefixItems``, length / item / numeric
    bounds, ``const`` / ``enum`` of scalars, ``anyOf`` / ``allOf`` / ``not``, local ``$ref``,
    ``contains`` (without ``minContains`` / ``maxContains`` other than ``minContains`` 0 or 1),
    and conjunctions of these. Raises ``Inexpressible`` otherwise.

    ``context``: the types of the schema the negation will be intersected with, if known. "not
    an integer" has no positive form ("a number with a fraction" cannot be written), but inside
    a context that allows no non-integral number it is just "not a number".
    """
    if depth > 8:
        raise Inexpressible("too deep")
    if node is True or node == {}:
        return False
    if node is False:
        return True
    if not isinstance(node, dict):
        raise Inexpressible("not a schema")
    keys = constraining_keys(node)
    if not keys:
        return False
    parts: list[Schema] = []
    for k in sorted(keys):
        v = node[k]
        if k == "$ref":
            parts.append(negate(resolve(v), resolve, depth + 1, context))
        elif k == "type":
            ts = {v} if isinstance(v, str) else set(v)
            if "integer" in ts and "number" not in ts:
                if context is None or "number" in context:
                    raise Inexpressible("not integer")
                ts.add("number")
            rest = [t for t in ALL_TYPES if t not in ts]
            parts.append({"type": rest} if rest else False)
        elif k == "required":
            if v:
                parts.append({"type": "object", "anyOf": [{"properties": {r: False}} for r in v]})
        elif k == "properties":
            for name, sub in v.items():
                neg = negate(sub, resolve, depth + 1)
                if neg is not False:
                    parts.append({"type": "object", "required": [name], "properties": {name: neg}})
        elif k in ("minLength", "maxLength", "minItems", "maxItems"):
            kind = "string" if k.endswith("Length") else "array"
            other = {"minLength": "maxLength", "maxLength": "minLength", "minItems": "maxItems", "maxItems": "minItems"}[k]
            if k.startswith("min"):
                if v > 0:
                    parts.append({"type": kind, other: v - 1})
            else:
                parts.append({"type": kind, other: v + 1})
        elif k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
            other = {"minimum": "exclusiveMaximum", "maximum": "exclusiveMinimum",
                     "exclusiveMinimum": "maximum", "exclusiveMaximum": "minimum"}[k]
            parts.append({"type": "number", other: v})
        elif k == "prefixItems":
            # Some item i (present) fails its schema; earlier items are free.
            for i, sub in enumerate(v):
                neg = negate(sub, resolve, depth + 1)
                if neg is not False:
                    parts.append({"type": "array", "minItems": i + 1, "prefixItems": [True] * i + [neg]})
        elif k == "anyOf":
            parts.append({"allOf": [negate(s, resolve, depth + 1, context) for s in v]})
        elif k == "allOf":
            parts.extend(negate(s, resolve, depth + 1, context) for s in v)
        elif k == "contains":
            # "some item matches" fails exactly when every item fails; minContains 0 always holds.
            lo, hi = node.get("minContains", 1), node.get("maxContains")
            if hi is None and lo == 1:
                parts.append({"type": "array", "items": negate(v, resolve, depth + 1)})
            elif not (hi is None and lo == 0):
                raise Inexpressible("minContains / maxContains")
        elif k in ("minContains", "maxContains"):
            continue  # read with `contains`; without it they constrain nothing
        elif k == "not":
            parts.append(v)
        elif k in ("const", "enum"):
            values = [v] if k == "const" else v
            if not isinstance(values, list):
                raise Inexpressible(k)
            parts.append(_negate_values(values))
        else:
            raise Inexpressible(k)
    parts = [p for p in parts if p is not False]
    if not parts:
        return False
    if any(p is True or p == {} for p in parts):
        return True
    return parts[0] if len(parts) == 1 else {"anyOf": parts}


def _negate_values(values: list) -> Schema:
    """Every JSON value except ``values`` (scalars only)."""
    present = {"number" if _value_type(v) == "integer" else _value_type(v) for v in values}
    if present & {"object", "array"}:
        raise Inexpressible("enum of objects or arrays")
    parts: list[Schema] = []
    free = [t for t in ALL_TYPES if t not in present]
    if free:
        parts.append({"type": free})
    bools = {v for v in values if isinstance(v, bool)}
    if len(bools) == 1:
        parts.append({"const": not bools.pop()})
    numbers = sorted({exact(v) for v in values if is_number(v)})
    if numbers:
        parts.append({"type": "number", "exclusiveMaximum": numbers[0]})
        parts.extend({"type": "number", "exclusiveMinimum": a, "exclusiveMaximum": b} for a, b in zip(numbers, numbers[1:]))
        parts.append({"type": "number", "exclusiveMinimum": numbers[-1]})
    strings = [v for v in values if isinstance(v, str)]
    if strings:
        if sum(map(len, strings)) > 4000:
            raise Inexpressible("enum too large to negate")
        parts.append({"type": "string", "pattern": "^(?:" + complement_regex(strings) + ")$"})
    if not parts:
        return False
    return parts[0] if len(parts) == 1 else {"anyOf": parts}


_REGEX_META = set("\\^$.|?*+()[]{}/-")


def _rx_char(c: str, in_class: bool = False) -> str:
    if c in _REGEX_META or (in_class and c in "]^-"):
        return "\\" + c
    o = ord(c)
    if o < 0x20 or o == 0x7F:
        return f"\\x{o:02x}"
    return c


def complement_regex(words: list[str]) -> str:
    """An ECMA regex matching exactly the strings *not* in ``words`` (use it anchored)."""
    trie: dict = {}
    for w in words:
        node = trie
        for c in w:
            node = node.setdefault(c, {})
        node[None] = True

    def comp(node: dict) -> str:
        alts = [] if node.get(None) else [""]
        children = sorted(k for k in node if k is not None)
        if children:
            alts.append("[^" + "".join(_rx_char(c, True) for c in children) + "][\\s\\S]*")
            alts.extend(_rx_char(c) + "(?:" + comp(node[c]) + ")" for c in children)
        else:
            alts.append("[\\s\\S]+")
        return "|".join(alts)

    return comp(trie)


def provably_disjoint(a: Schema, b: Schema, resolve: Callable[[str], Schema]) -> bool:
    """True when no instance can satisfy both ``a`` and ``b`` (a sound, incomplete check)."""
    a, b = deref(a, resolve), deref(b, resolve)
    if a is False or b is False:
        return True
    if not isinstance(a, dict) or not isinstance(b, dict):
        return False
    if _types_disjoint(type_set(a), type_set(b)):
        return True
    va, vb = _values(a), _values(b)
    if va is not None and vb is not None and not any(_json_eq(x, y) for x in va for y in vb):
        return True
    # Objects told apart by a required property whose allowed values do not overlap.
    pa, pb = a.get("properties") or {}, b.get("properties") or {}
    if type_set(a) == {"object"} or type_set(b) == {"object"}:
        # a property one side requires, whose value the other side constrains where present
        for x, y in ((a, b), (b, a)):
            px, py = x.get("properties") or {}, y.get("properties") or {}
            for name in x.get("required") or []:
                if isinstance(name, str) and name in px and name in py and provably_disjoint(px[name], py[name], resolve):
                    return True
        for x, y in ((a, b), (b, a)):
            px = x.get("properties") or {}
            closed = x.get("additionalProperties") is False and not x.get("patternProperties")
            for name in y.get("required") or []:
                if px.get(name) is False or (closed and name not in px):
                    return True
    return False


def deref(node: Schema, resolve: Callable[[str], Schema], depth: int = 0) -> Schema:
    while isinstance(node, dict) and "$ref" in node and len(constraining_keys(node)) == 1 and depth < 8:
        node = resolve(node["$ref"])
        depth += 1
    return node


def _values(node: dict) -> list | None:
    if "const" in node:
        return [node["const"]]
    if isinstance(node.get("enum"), list):
        return node["enum"]
    return None


def _json_eq(x: Any, y: Any) -> bool:
    if isinstance(x, bool) or isinstance(y, bool):
        return type(x) is type(y) and x == y
    return x == y


# ---------------------------------------------------------------------------------------------


def prune_alternatives(neg: Schema, contexts: list[Schema], resolve: Callable[[str], Schema]) -> Schema:
    """``neg`` (a negation about to be intersected with every schema of ``contexts``) without
    the ``anyOf`` alternatives that are provably disjoint from one of the contexts: those can
    hold no instance of the intersection, so dropping them changes nothing but what a backend
    has to build. ``False`` if no alternative is left."""
    if not isinstance(neg, dict) or set(neg) != {"anyOf"} or not isinstance(neg["anyOf"], list):
        alternatives = [neg]
    else:
        alternatives = neg["anyOf"]
    kept = [alt for alt in alternatives if not any(provably_disjoint(alt, c, resolve) for c in contexts)]
    if not kept:
        return False
    if len(kept) == len(alternatives):
        return neg
    return kept[0] if len(kept) == 1 else {"anyOf": kept}
