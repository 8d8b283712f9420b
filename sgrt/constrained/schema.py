"""JSON Schema inputs -> one normalized dict that a grammar backend can compile, or a GrammarError.

Three steps, in order (:func:`normalize_schema`):

1. **Load** (:func:`load_schema`): a dict, JSON text, a Pydantic model class, a msgspec Struct
   type or a dataclass becomes a plain dict.
2. **Generation options** (:class:`~sgrt.constrained.options.GrammarOptions`): older drafts are
   upgraded to 2020-12 forms (``items: [...]`` -> ``prefixItems``, boolean ``exclusiveMinimum``,
   ``$ref`` siblings dropped before 2019-09); objects are closed by default; free strings get a
   length cap; unknown ``format`` values are dropped with a warning (an annotation, as 2020-12
   says); known formats (:data:`~sgrt.constrained.formats.KNOWN_FORMATS`) are kept and enforced.
3. **Keyword rewrites and checks**: keywords no backend implements are rewritten into ones they
   do when that is exact (``not`` over types / ``required`` / bounds, ``if``/``then``/``else``,
   ``dependentRequired`` / ``dependentSchemas`` / ``dependencies``, ``oneOf`` that is provably
   exclusive or can be made so with negations, ``propertyNames`` on closed objects,
   ``unevaluated*`` on plain nodes); everything else that would change which instances are valid
   fails closed: a :class:`~sgrt.errors.GrammarError` naming the keyword and its JSON pointer.
   Patterns with lookaround or backreferences fail here too.
"""
from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urldefrag, urljoin

from sgrt.constrained.formats import FORMAT_REGEXES, KNOWN_FORMATS, LLGUIDANCE_OVERRIDES
from sgrt.constrained.options import GrammarOptions
from sgrt.constrained.patterns import UnsupportedPattern, check_pattern, llguidance_pattern
from sgrt.constrained.schema_algebra import (
    ALL_TYPES,
    VALIDATION_KEYWORDS,
    Inexpressible,
    Schema,
    TYPES,
    constraining_keys,
    declares_keys,
    deref,
    escape_pointer,
    map_subschemas,
    negate,
    provably_disjoint,
    subschemas,
    type_set,
    unescape_pointer,
)
from sgrt.errors import GrammarError
from sgrt.schema_value import schema_value

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


def _spell_values(node: Schema) -> Schema:
    """``const`` / ``enum`` objects, which llguidance would match only as one literal text,
    rewritten (llguidance only, after the rewrites) into ``properties`` of the members' values,
    all ``required``, closed: an instance lists the keys in the grammar's order (as for every
    object), whatever order the schema wrote them in. Other values stay literals (an integral
    number is written without a fraction: ``1``, not ``1.0``; a departure)."""
    if not isinstance(node, dict):
        return node
    node = map_subschemas(node, lambda sub, _p: _spell_values(sub), "")
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
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@dataclass
class NormalizedSchema:
    """A schema ready for a backend (``schema``) and the warnings collected on the way."""

    schema: Schema
    warnings: list[str] = field(default_factory=list)


def load_schema(spec: Any) -> Schema:
    """Turn a ``json_schema`` request value into a dict (or a boolean schema) of our own: a dict
    is deep-copied (the rewrites change it); the rest as :func:`sgrt.schema_value.schema_value`
    reads it.

    Raises:
        GrammarError: (field ``json_schema``) invalid JSON text, or a type we cannot read.
    """
    if isinstance(spec, dict):
        return copy.deepcopy(spec)
    return schema_value(spec)


def normalize_schema(spec: Any, options: GrammarOptions, backend: str = "llguidance") -> NormalizedSchema:
    """Load ``spec`` and apply options, rewrites and checks (see the module docstring).

    Args:
        spec: any input :func:`load_schema` accepts.
        options: generation options.
        backend: ``"llguidance"`` or ``"outlines"``. The default string cap is not applied for
            outlines-core: its index grows with every bounded character (see
            :class:`~sgrt.constrained.options.GrammarOptions`).

    Raises:
        GrammarError: naming the unsupported keyword and its JSON pointer (``path``).
    """
    return normalize_loaded(load_schema(spec), options, backend)


def normalize_loaded(root: Schema, options: GrammarOptions, backend: str = "llguidance") -> NormalizedSchema:
    """:func:`normalize_schema` of a schema that :func:`load_schema` already returned (a copy
    of our own, which the rewrites change in place): the grammar compiler loads once, to check
    the limits and make its cache key, and normalizes that copy. Raises as
    :func:`normalize_schema`.
    """
    if root is False:
        raise GrammarError("json_schema is `false`: no value is valid", field="json_schema", path="")
    if root is True:
        root = {}
    n = _Normalizer(root, options, backend)
    schema = n.run()
    return NormalizedSchema(schema, n.warnings)




class _Normalizer:
    def __init__(self, root: dict, options: GrammarOptions, backend: str):
        self.root = root
        self.options = options
        self.backend = backend
        self.warnings: list[str] = []
        schema_uri = root.get("$schema", "") if isinstance(root, dict) else ""
        self.old_draft = isinstance(schema_uri, str) and any(d in schema_uri for d in _OLD_DRAFTS)
        self.root_id = root.get("$id") or root.get("id") if isinstance(root, dict) else None
        self.anchors: dict[str, str] = {}
        self._collect_anchors(root, "")

    # ---- entry ----------------------------------------------------------------------------

    def run(self) -> Schema:
        upgraded = self._upgrade(self.root, "")
        upgraded = self._localize_refs(upgraded)
        self.upgraded = upgraded
        keep_open = self._composed_paths(upgraded) if self.options.additional_properties_default == "closed" else None
        with_options = self._apply_options(upgraded, "", keep_open, negated=False)
        with_options = self._resolve_unevaluated(with_options, "", with_options)
        self.current = with_options
        self._rewritten: dict[str, Schema] = {}
        out = self._rewrite(with_options, "")
        out = self._rewrite_contains(out, "", in_one_of=False)
        out = strip_marks(out)
        if self.backend == "llguidance":
            self._uses_multiple_of = '"multipleOf"' in json.dumps(out)
            out = self._bound_numbers(out, "")
            out = _spell_values(out)
            out = self._llguidance_patterns(out, "")
            if isinstance(out, dict) and mixes_named_and_free_keys(out):
                out = {**out, PLAIN_ESCAPES_KEY: True}
        return out

    # ---- references -----------------------------------------------------------------------

    def _localize_refs(self, root: Schema) -> Schema:
        """Embedded resources (a nested ``$id``): every ``$ref`` that resolves, against the base
        URI of where it sits (RFC 3986 section 5), to a resource of this document becomes a local
        ``#/pointer``, and the nested ``$id`` are dropped, so backends see one resource. A ``$ref``
        to anything else is left as written (and refused later as remote)."""
        if not isinstance(root, dict):
            return root
        root_base = root.get("$id") if isinstance(root.get("$id"), str) else _ROOT_BASE
        resources: dict[str, str] = {}
        anchors: dict[tuple[str, str], str] = {}  # (resource URI, anchor name) -> pointer
        nested = []

        def collect(node: Schema, path: str, base: str) -> None:
            if not isinstance(node, dict):
                return
            if isinstance(node.get("$id"), str):
                base = urldefrag(urljoin(base, node["$id"]))[0]
                resources.setdefault(base, path)
                if path:
                    nested.append(path)
            if isinstance(node.get("$anchor"), str):
                anchors[(base, node["$anchor"])] = path
            for rel, sub in subschemas(node):
                collect(sub, path + rel, base)

        collect(root, "", root_base)
        if not nested:
            return root
        resources.setdefault(urldefrag(root_base)[0], "")

        def localize(node: Schema, path: str, base: str) -> Schema:
            if not isinstance(node, dict):
                return node
            node = dict(node)
            if isinstance(node.get("$id"), str):
                base = urldefrag(urljoin(base, node["$id"]))[0]
                if path:
                    node.pop("$id")
            ref = node.get("$ref")
            if isinstance(ref, str):
                uri, frag = urldefrag(urljoin(base, ref))
                if uri in resources:
                    if not frag or frag.startswith("/"):
                        node["$ref"] = "#" + resources[uri] + frag
                    elif (uri, frag) in anchors:
                        node["$ref"] = "#" + anchors[(uri, frag)]
            return map_subschemas(node, lambda sub, p: localize(sub, p, base), path)

        return localize(root, "", root_base)

    def _collect_anchors(self, node: Schema, path: str) -> None:
        if isinstance(node, dict):
            if isinstance(node.get("$anchor"), str):
                name = node["$anchor"]
                # The same name in two resources: a bare "#name" is ambiguous here (refused).
                self.anchors[name] = path if name not in self.anchors else None
            for rel, sub in subschemas(node):
                self._collect_anchors(sub, path + rel)

    def ref_pointer(self, ref: Any, path: str) -> str:
        """The JSON pointer (in this document) that ``ref`` names."""
        if not isinstance(ref, str):
            raise GrammarError(f"$ref at {path or '/'} must be a string", field="json_schema", path=path + "/$ref")
        base, _, frag = ref.partition("#")
        if base and base != self.root_id:
            raise GrammarError(
                f"$ref {ref!r} at {path or '/'} points outside this schema; remote references are not supported",
                field="json_schema", path=path + "/$ref",
            )
        if frag and not frag.startswith("/"):
            if self.anchors.get(frag) is not None:
                return self.anchors[frag]
            raise GrammarError(f"$ref {ref!r} at {path or '/'}: unknown anchor", field="json_schema", path=path + "/$ref")
        return frag

    def lookup(self, tree: Schema, pointer: str, path: str) -> Schema:
        node = tree
        for part in pointer.split("/")[1:] if pointer else []:
            part = unescape_pointer(part)
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                raise GrammarError(
                    f"$ref '#{pointer}' at {path or '/'} does not resolve", field="json_schema", path=path + "/$ref"
                )
        return node

    # ---- step 2a: draft upgrade -------------------------------------------------------------

    def _upgrade(self, node: Schema, path: str) -> Schema:
        if not isinstance(node, dict):
            return node
        node = dict(node)
        if self.old_draft and "$ref" in node:
            node = {k: v for k, v in node.items() if k in ("$ref", "$defs", "definitions") or k in _ANNOTATIONS}
        if isinstance(node.get("items"), list):
            node["prefixItems"] = node.pop("items")
            if "additionalItems" in node:
                node["items"] = node.pop("additionalItems")
        else:
            node.pop("additionalItems", None)
        for key, bound in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
            if isinstance(node.get(key), bool):
                if node.pop(key) and bound in node:
                    node[key] = node.pop(bound)
        if "dependencies" in node:
            deps = node.pop("dependencies")
            if isinstance(deps, dict):
                for name, dep in deps.items():
                    if isinstance(dep, list):
                        node.setdefault("dependentRequired", {})[name] = dep
                    else:
                        node.setdefault("dependentSchemas", {})[name] = dep
        if node.get("uniqueItems") is False:
            node.pop("uniqueItems")
        for k in _COUNT_KEYS:  # 2.0 is an integer to JSON Schema (2020-12, section 6)
            if isinstance(node.get(k), float) and node[k].is_integer():
                node[k] = int(node[k])
        return map_subschemas(node, self._upgrade, path)

    # ---- step 2b: which object schemas must stay open ---------------------------------------

    def _composed_paths(self, tree: Schema) -> set[str]:
        """Paths of object schemas that are intersected with others that declare more keys
        (allOf members, anyOf branches under a parent with ``properties``, sibling ``$ref``
        targets, ...): closing them would forbid the other side's keys."""
        composed: set[str] = set()
        pending: list[tuple[Schema, str, bool]] = [(tree, "", False)]
        seen: set[tuple[str, bool]] = set()
        while pending:
            node, path, in_comp = pending.pop()
            if (path, in_comp) in seen or not isinstance(node, dict):
                continue
            seen.add((path, in_comp))
            own = declares_keys(node)
            if in_comp or (own and self._members_declare_more(tree, node, path)):
                composed.add(path)
            if "$ref" in node and (in_comp or len(constraining_keys(node)) > 1):
                try:
                    target = self.ref_pointer(node["$ref"], path)
                    pending.append((self.lookup(tree, target, path), target, True))
                except GrammarError:
                    pass
            for rel, sub in subschemas(node):
                key = rel.split("/")[1]
                if key in ("allOf", "then", "else", "dependentSchemas"):
                    child_comp = True
                elif key in ("anyOf", "oneOf"):
                    child_comp = in_comp or own
                else:
                    child_comp = False
                pending.append((sub, path + rel, child_comp))
        return composed

    def _members_declare_more(self, tree: Schema, node: dict, path: str, depth: int = 0) -> bool:
        """Whether an applicator member or ``$ref`` target of ``node`` may allow keys that
        ``node``'s own ``properties`` do not list."""
        mine = set(node.get("properties") or {})
        members: list[Schema] = []
        for k in _APPLICATORS:
            if isinstance(node.get(k), list):
                members.extend(node[k])
        members.extend(node[k] for k in ("then", "else") if k in node)
        members.extend((node.get("dependentSchemas") or {}).values())
        if "$ref" in node:
            try:
                members.append(self.lookup(tree, self.ref_pointer(node["$ref"], path), path))
            except GrammarError:
                return True
        for m in members:
            if not isinstance(m, dict):
                continue
            if m.get("patternProperties") or isinstance(m.get("additionalProperties"), dict) \
                    or m.get("additionalProperties") is True:
                return True
            if set(m.get("properties") or {}) - mine:
                return True
            if depth < 4 and self._members_declare_more(tree, m, path, depth + 1):
                return True
        return False

    # ---- step 2c: closing, string caps, formats ---------------------------------------------

    def _apply_options(self, node: Schema, path: str, keep_open: set[str] | None, negated: bool) -> Schema:
        if not isinstance(node, dict):
            return node
        node = dict(node)
        fmt = node.get("format")
        if fmt is not None and (not isinstance(fmt, str) or fmt not in KNOWN_FORMATS):
            node.pop("format")
            self.warnings.append(
                f"unknown format {fmt!r} at {path or '/'} ignored (treated as an annotation, as JSON Schema 2020-12 says)"
            )
        elif fmt in LLGUIDANCE_OVERRIDES and self.backend == "llguidance":
            node.pop("format")
            rx = f"^{FORMAT_REGEXES[fmt]}$"
            if "pattern" in node:
                node["allOf"] = list(node.get("allOf") or []) + [{"pattern": rx}]
            else:
                node["pattern"] = rx
        if not negated:
            if (
                keep_open is not None
                and "properties" in node
                and "additionalProperties" not in node
                and "unevaluatedProperties" not in node
                and path not in keep_open
            ):
                node["additionalProperties"] = False
                _mark_narrowed(node, "additionalProperties")
            cap = self.options.max_string_length
            ts = type_set({"type": node["type"]}) if "type" in node else None
            if (
                cap is not None
                and ts is not None
                and "string" in ts
                and not any(k in node for k in ("maxLength", "enum", "const"))
                and self.backend != "outlines"
            ):
                min_len = node.get("minLength", 0)
                node["maxLength"] = max(cap, min_len if isinstance(min_len, int) else 0)
                _mark_narrowed(node, "maxLength")

        def child(sub: Schema, sub_path: str) -> Schema:
            key = sub_path[len(path):].split("/")[1]
            return self._apply_options(sub, sub_path, keep_open, negated or key in ("not", "if", "propertyNames", "contains"))

        return map_subschemas(node, child, path)

    # ---- step 2d: unevaluatedProperties / unevaluatedItems, resolved statically ------------

    def _resolve_unevaluated(self, node: Schema, path: str, tree: Schema) -> Schema:
        """Rewrite ``unevaluatedProperties`` / ``unevaluatedItems`` into an ``allOf`` member
        that names what the node's other keywords evaluate for sure (``properties``,
        ``patternProperties`` / ``prefixItems``, through ``allOf``, local ``$ref``,
        ``anyOf`` / ``oneOf`` / ``if`` branch by branch) and applies the keyword's schema to
        the rest (``additionalProperties`` / ``items``).

        Sound by construction: what :meth:`_evaluated` counts is a subset of what JSON Schema
        2020-12 counts as evaluated for any instance the node accepts (keywords it cannot see
        through, like ``dependentSchemas`` or ``contains``, count as evaluating nothing), so the
        rewrite applies the schema to at least every unevaluated member. It may reject a valid
        instance (a key evaluated only by such a keyword), never accept an invalid one.
        Top-down on the user's tree, so nested ``unevaluated*`` are seen as written.
        """
        if not isinstance(node, dict):
            return node
        for key in ("unevaluatedProperties", "unevaluatedItems"):
            if key in node:
                node = self._resolve_one_unevaluated(node, key, tree, path)
        if not isinstance(node, dict):
            return node
        return map_subschemas(node, lambda sub, p: self._resolve_unevaluated(sub, p, tree), path)

    def _resolve_one_unevaluated(self, node: dict, key: str, tree: Schema, path: str) -> dict:
        objs = key == "unevaluatedProperties"
        extra = node[key]
        rest = {k: v for k, v in node.items() if k != key}
        if extra is True or extra == {}:
            return rest
        groups = [k for k in ("anyOf", "oneOf") if isinstance(rest.get(k), list)]
        split = groups[0] if len(groups) == 1 and "if" not in rest else "if" if "if" in rest and not groups else None
        base = {k: v for k, v in rest.items() if k not in ((split,) if split != "if" else ("if", "then", "else"))}
        e_base = self._evaluated(base, objs, tree, frozenset())
        if split is None:
            alternatives = [(None, e_base)]
        elif split == "if":
            cond, then, other = rest["if"], rest.get("then", True), rest.get("else", True)
            alternatives = [
                ({"allOf": [cond, then]}, e_base | self._evaluated(cond, objs, tree, frozenset())
                 | self._evaluated(then, objs, tree, frozenset())),
                ({"allOf": [{"not": cond}, other]}, e_base | self._evaluated(other, objs, tree, frozenset())),
            ]
        else:
            alternatives = [(b, e_base | self._evaluated(b, objs, tree, frozenset())) for b in rest[split]]
        members = []
        for branch, ev in alternatives:
            if ev.all:
                members.append(branch if branch is not None else True)
                continue
            if objs:
                rule: dict = {"additionalProperties": extra}
                if ev.names:
                    rule["properties"] = {n: {} for n in ev.names}
                if ev.patterns:
                    rule["patternProperties"] = {p: {} for p in ev.patterns}
            else:
                rule = {"items": extra}
                if ev.items:
                    rule["prefixItems"] = [{} for _ in range(ev.items)]
            members.append(rule if branch is None else {"allOf": [branch, rule]})
        if all(m is True for m in members):
            return rest
        # Only ever narrows the node (see _evaluated); negations see it as `true` (relax).
        added = {"anyOf": members, NARROWED_KEY: True}
        rest["allOf"] = list(rest.get("allOf") or []) + [added]
        return rest

    def _evaluated(self, node: Schema, objs: bool, tree: Schema, seen: frozenset) -> "_Evaluated":
        """What ``node`` evaluates for sure at its own instance location, when it accepts."""
        if node is False:
            return _Evaluated(all=True)  # never valid: anything may be assumed
        if not isinstance(node, dict):
            return _Evaluated()
        if objs:
            ev = _Evaluated(names=tuple(n for n in (node.get("properties") or {}) if isinstance(n, str)),
                            patterns=tuple(node.get("patternProperties") or {}),
                            all="additionalProperties" in node or "unevaluatedProperties" in node)
        else:
            prefix = node.get("prefixItems")
            ev = _Evaluated(items=len(prefix) if isinstance(prefix, list) else 0,
                            all="items" in node or "unevaluatedItems" in node)
        for m in node.get("allOf") or []:
            ev = ev | self._evaluated(m, objs, tree, seen)
        if isinstance(node.get("$ref"), str) and node["$ref"] not in seen:
            try:
                target = self.lookup(tree, self.ref_pointer(node["$ref"], ""), "")
            except GrammarError:
                target = True
            ev = ev | self._evaluated(target, objs, tree, seen | {node["$ref"]})
        for k in ("anyOf", "oneOf"):
            if isinstance(node.get(k), list) and node[k]:
                branches = [self._evaluated(b, objs, tree, seen) for b in node[k]]
                common = branches[0]
                for b in branches[1:]:
                    common = common & b
                ev = ev | common
        if "if" in node:
            then = self._evaluated(node["if"], objs, tree, seen) | self._evaluated(node.get("then", True), objs, tree, seen)
            ev = ev | (then & self._evaluated(node.get("else", True), objs, tree, seen))
        return ev

    def _bound_numbers(self, node: Schema, path: str) -> Schema:
        """Default digit bounds on every number schema in a positive position of the rewritten
        tree (see GrammarOptions.max_integer_digits). Done after the rewrites so that negations
        (``not``, ``if``, ``oneOf``) see the user's schema, not our bounds."""
        if not isinstance(node, dict):
            return node
        ts = type_set({"type": node["type"]}) if "type" in node else None
        if ts is not None and ts & {"number", "integer"} and not any(k in node for k in ("enum", "const")):
            node = dict(node)
            self._bound_number(node, ts)

        def child(sub: Schema, sub_path: str) -> Schema:
            key = sub_path[len(path):].split("/")[1]
            return sub if key in ("not", "if", "propertyNames", "contains") else self._bound_numbers(sub, sub_path)

        return map_subschemas(node, child, path)

    def _bound_number(self, node: dict, ts: set[str]) -> None:
        """Default digit bounds on one number schema, on the sides it leaves open."""
        digits = self.options.max_integer_digits
        if digits is not None:
            limit = 10**digits - 1
            lows = [node[k] for k in ("minimum", "exclusiveMinimum") if _is_num(node.get(k))]
            highs = [node[k] for k in ("maximum", "exclusiveMaximum") if _is_num(node.get(k))]
            if not highs and all(lo < limit for lo in lows):
                node["maximum"] = limit
            if not lows and all(hi > -limit for hi in highs):
                node["minimum"] = -limit
        frac = self.options.max_fraction_digits
        # llguidance does not intersect two multipleOf (allOf members, $ref siblings): a schema
        # that uses multipleOf anywhere keeps its own.
        if frac is not None and "number" in ts and not self._uses_multiple_of:
            node["multipleOf"] = float(f"1e-{frac}")

    # ---- step 3: rewrites and checks --------------------------------------------------------

    def _resolve_current(self, ref: str) -> Schema:
        """The target of ``ref`` as negations and disjointness proofs must see it: without the
        narrowing we added (:func:`relax`)."""
        pointer = self.ref_pointer(ref, "")
        return relax(self.lookup(self.current, pointer, ""))

    def _rewrite(self, node: Schema, path: str) -> Schema:
        if not isinstance(node, dict):
            return node
        for k in node:
            if k in _UNSUPPORTED:
                self._fail(k, path, f"{_UNSUPPORTED[k]} cannot be enforced by a token grammar")
        if node.get("uniqueItems") is True:
            if isinstance(node.get("maxItems"), int) and node["maxItems"] <= 1:
                node = {k: v for k, v in node.items() if k != "uniqueItems"}
            else:
                self._fail("uniqueItems", path, "unique array items cannot be enforced by a token grammar")
        self._check_types(node, path)
        if "$ref" in node:
            self.ref_pointer(node["$ref"], path)  # raises for remote / bad refs
        if "pattern" in node:
            self._check_pattern(node["pattern"], f"{path}/pattern")
        for name in (node.get("patternProperties") or {}):
            self._check_pattern(name, f"{path}/patternProperties/{escape_pointer(name)}")
        node = map_subschemas(node, self._rewrite, path)
        for step in (
            self._rewrite_unevaluated,
            self._rewrite_property_names,
            self._rewrite_dependencies,
            self._rewrite_conditionals,
            self._rewrite_not,
            self._rewrite_one_of,
        ):
            if not isinstance(node, dict):
                break
            node = step(node, path)
        return node

    def _rewrite_contains(self, node: Schema, path: str, in_one_of: bool) -> Schema:
        """``contains`` / ``minContains`` / ``maxContains`` (2020-12) as a sound subset, after
        the exact rewrites (so a negated ``contains`` was already rewritten exactly by
        :func:`negate`). With m = ``minContains`` (default 1) and M = ``maxContains``: the first
        m items must match the ``contains`` schema (``prefixItems``, intersected with the node's
        own item schemas through ``allOf``); with M, the items after them must not match it when
        the ``contains`` schema has an exact negation (the count is then exactly m), else the
        array has at most M items. m > M allows no array. A grammar cannot count matches spread
        anywhere in the array: valid arrays whose matches come later are rejected (a departure),
        no invalid one is accepted. Inside a ``oneOf`` left to the backend it is refused (the
        backend's exclusivity proof would be about the subset).

        Raises:
            GrammarError: bad ``minContains`` / ``maxContains`` values, ``minContains`` over
                :data:`MAX_MIN_CONTAINS`, or ``contains`` under a backend-checked ``oneOf``.
        """
        if not isinstance(node, dict):
            return node
        if "contains" in node:
            if in_one_of:
                self._fail("contains", path, "it sits in a oneOf whose branches could not be proved exclusive")
            lo, hi = node.get("minContains", 1), node.get("maxContains")
            for key, value in (("minContains", lo), ("maxContains", hi)):
                if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
                    raise GrammarError(f"{key} at {path or '/'} must be a non-negative integer",
                                       field="json_schema", path=f"{path}/{key}")
            if lo > MAX_MIN_CONTAINS:
                self._fail("minContains", path, f"more than {MAX_MIN_CONTAINS} required matches")
            target = node["contains"]
            node = {k: v for k, v in node.items() if k not in ("contains", "minContains", "maxContains")}
            member: dict = {}
            if hi is not None and lo > hi:
                member["type"] = [t for t in ALL_TYPES if t != "array"]
            else:
                if lo > 0:
                    positive = self._apply_options(target, f"{path}/contains", None, negated=False)
                    member["prefixItems"] = [positive] * lo
                    member["minItems"] = lo
                if hi is not None:
                    try:
                        member["items"] = negate(relax(target), self._resolve_current)
                    except Inexpressible:
                        member["maxItems"] = hi
            if member:
                node["allOf"] = list(node.get("allOf") or []) + [{**member, NARROWED_KEY: True}]
        else:
            node = {k: v for k, v in node.items() if k not in ("minContains", "maxContains")}

        def child(sub: Schema, sub_path: str) -> Schema:
            return self._rewrite_contains(sub, sub_path, in_one_of or sub_path[len(path):].startswith("/oneOf/"))

        return map_subschemas(node, child, path)

    def _fail(self, keyword: str, path: str, why: str) -> None:
        raise GrammarError(
            f"json_schema keyword {keyword!r} at {path or '/'} is not supported: {why}",
            field="json_schema",
            path=f"{path}/{keyword}",
        )

    def _check_types(self, node: dict, path: str) -> None:
        t = node.get("type")
        if t is None:
            return
        ts = [t] if isinstance(t, str) else t if isinstance(t, list) else None
        if ts is None or any(x not in TYPES for x in ts):
            raise GrammarError(f"bad 'type' {t!r} at {path or '/'}", field="json_schema", path=f"{path}/type")

    def _check_pattern(self, pattern: Any, path: str) -> None:
        if not isinstance(pattern, str):
            raise GrammarError(f"pattern at {path} must be a string", field="json_schema", path=path)
        problem = check_pattern(pattern)
        if problem is not None:
            raise GrammarError(
                f"json_schema pattern {pattern!r} at {path} is not supported: {problem.construct!r}: {problem.reason}",
                field="json_schema",
                path=path,
            )

    def _llguidance_patterns(self, node: Schema, path: str) -> Schema:
        """Apply :func:`llguidance_pattern` to every pattern of the tree."""
        if not isinstance(node, dict):
            return node

        def fix(pattern: str, where: str) -> str:
            try:
                return llguidance_pattern(pattern)
            except UnsupportedPattern as e:
                raise GrammarError(
                    f"json_schema pattern {pattern!r} at {where} is not supported: {e}", field="json_schema", path=where
                ) from None

        node = dict(node)
        if isinstance(node.get("pattern"), str):
            node["pattern"] = fix(node["pattern"], f"{path}/pattern")
        if isinstance(node.get("patternProperties"), dict):
            node["patternProperties"] = {
                fix(k, f"{path}/patternProperties/{escape_pointer(k)}"): v for k, v in node["patternProperties"].items()
            }
        return map_subschemas(node, self._llguidance_patterns, path)

    def _rewrite_unevaluated(self, node: dict, path: str) -> dict:
        plain = not any(k in node for k in _APPLICATORS + ("$ref", "if", "dependentSchemas"))
        for key, target in (("unevaluatedProperties", "additionalProperties"), ("unevaluatedItems", "items")):
            if key not in node:
                continue
            if plain and target not in node:
                node = dict(node)
                node[target] = node.pop(key)
            elif node[key] is True:
                node = {k: v for k, v in node.items() if k != key}
            else:
                self._fail(key, path, "it depends on what other subschemas evaluated")
        return node

    def _rewrite_property_names(self, node: dict, path: str) -> dict:
        """``propertyNames``: checked statically against ``properties`` keys; on a map
        (``additionalProperties``) a pattern / enum / length rule becomes ``patternProperties``
        / ``properties`` with the map's value schema, and the object is closed."""
        if "propertyNames" not in node:
            return node
        names = node["propertyNames"]
        node = {k: v for k, v in node.items() if k != "propertyNames"}
        if names is True or names == {}:
            return node
        props = dict(node.get("properties") or {})
        if props:
            import jsonschema

            sub = dict(names) if isinstance(names, dict) else names
            if isinstance(sub, dict):
                for k in ("$defs", "definitions"):
                    if k in self.current:
                        sub[k] = self.current[k]
            validator = jsonschema.Draft202012Validator(sub)
            for name in props:
                if not validator.is_valid(name):
                    props[name] = False
            node["properties"] = props
        if node.get("additionalProperties") is False and not node.get("patternProperties"):
            return node
        if node.get("patternProperties") or not isinstance(names, dict):
            self._fail("propertyNames", path, "key names can be checked only on closed objects or plain maps")
        rule = {k: v for k, v in names.items() if k in VALIDATION_KEYWORDS}
        if rule.get("type", "string") != "string" or set(rule) - {"type", "pattern", "enum", "const", "minLength", "maxLength"}:
            self._fail("propertyNames", path, "only pattern / enum / const / length rules on key names are supported")
        extra = node.get("additionalProperties", True)
        node["additionalProperties"] = False
        if "enum" in rule or "const" in rule:
            allowed = rule["enum"] if "enum" in rule else [rule["const"]]
            for name in allowed:
                if isinstance(name, str) and name not in props:
                    props[name] = extra
            node["properties"] = props
            return node
        if "pattern" in rule and ("minLength" in rule or "maxLength" in rule):
            self._fail("propertyNames", path, "a key pattern together with key length bounds")
        if "pattern" in rule:
            pattern = rule["pattern"]
            self._check_pattern(pattern, f"{path}/propertyNames/pattern")
        else:
            lo, hi = rule.get("minLength", 0), rule.get("maxLength", "")
            pattern = f"^[\\s\\S]{{{lo},{hi}}}$"
        node["patternProperties"] = {pattern: extra}
        return node

    def _rewrite_dependencies(self, node: dict, path: str) -> dict:
        extra: list[Schema] = []
        for name, req in (node.get("dependentRequired") or {}).items():
            extra.append({"anyOf": [{"properties": {name: False}}, {"required": [name, *req]}]})
        for name, sub in (node.get("dependentSchemas") or {}).items():
            extra.append({"anyOf": [{"properties": {name: False}}, {"allOf": [{"required": [name]}, sub]}]})
        if not extra:
            return node
        node = {k: v for k, v in node.items() if k not in ("dependentRequired", "dependentSchemas")}
        node["allOf"] = list(node.get("allOf") or []) + extra
        return node

    def _rewrite_conditionals(self, node: dict, path: str) -> dict:
        if "if" not in node:
            return {k: v for k, v in node.items() if k not in ("then", "else")}
        cond = node["if"]
        then, other = node.get("then", True), node.get("else", True)
        node = {k: v for k, v in node.items() if k not in ("if", "then", "else")}
        if then is True and other is True:
            return node
        try:
            neg = negate(relax(cond), self._resolve_current)
        except Inexpressible as e:
            self._fail("if", path, f"its condition cannot be negated exactly ({e})")
        branch = {"anyOf": [{"allOf": [cond, then]}, {"allOf": [neg, other]}]}
        node["allOf"] = list(node.get("allOf") or []) + [branch]
        return node

    def _rewrite_not(self, node: dict, path: str) -> dict:
        if "not" not in node:
            return node
        try:
            neg = negate(relax(node["not"]), self._resolve_current)
        except Inexpressible as e:
            self._fail("not", path, f"this negation cannot be expressed without `not` ({e})")
        node = {k: v for k, v in node.items() if k != "not"}
        if neg is False:
            return False
        if neg is not True:
            node["allOf"] = list(node.get("allOf") or []) + [neg]
        return node

    def _rewrite_one_of(self, node: dict, path: str) -> dict:
        branches = node.get("oneOf")
        if not isinstance(branches, list):
            return node
        res = self._resolve_current
        n = len(branches)
        wide = [relax(b) for b in branches]  # proofs about what the user wrote, not our narrowing
        overlap = {
            (i, j)
            for i in range(n)
            for j in range(n)
            if i != j and not provably_disjoint(wide[i], wide[j], res)
        }
        node = {k: v for k, v in node.items() if k != "oneOf"}
        if not overlap:
            return self._add_any_of(node, branches)
        if n <= 8:
            try:
                expanded = []
                for i in range(n):
                    ctx = type_set(deref(wide[i], res))
                    negs = [negate(wide[j], res, context=ctx) for j in range(n) if (i, j) in overlap]
                    expanded.append({"allOf": [branches[i], *negs]})
                return self._add_any_of(node, expanded)
            except Inexpressible:
                pass
        # Leave it to the backend (llguidance accepts oneOf when it can prove exclusivity itself),
        # with the branches as the user wrote them: a proof about branches we narrowed (closed,
        # capped) would not hold for the user's (issue 20). A branch with a narrowing we cannot
        # undo exactly (an unevaluated* or contains subset) is refused.
        if any(_narrowed_member(b) for b in branches):
            self._fail("oneOf", path, "its branches may overlap, and one of them is compiled as a subset")
        node["oneOf"] = wide
        return node

    @staticmethod
    def _add_any_of(node: dict, branches: list[Schema]) -> dict:
        if "anyOf" in node:
            node["allOf"] = list(node.get("allOf") or []) + [{"anyOf": branches}]
        else:
            node["anyOf"] = branches
        return node
