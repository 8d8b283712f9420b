"""The normalizer's step 3 (:mod:`sgrt.constrained.schema`): keywords no backend implements
rewritten into ones they do where that is exact (``not``, ``if``/``then``/``else``,
dependencies, exclusive ``oneOf``, ``propertyNames``, ``contains``), everything else refused
with the keyword and its JSON pointer; patterns checked for each backend."""
from __future__ import annotations

from typing import Any

from sgrt.constrained.ecma_regex import ecma_validator
from sgrt.constrained.numbers import plain_json
from sgrt.constrained.patterns import UnsupportedPattern, check_pattern, llguidance_pattern
from sgrt.constrained.schema_algebra import (
    ALL_TYPES,
    VALIDATION_KEYWORDS,
    Inexpressible,
    Schema,
    TYPES,
    deref,
    escape_pointer,
    map_subschemas,
    negate,
    provably_disjoint,
    prune_alternatives,
    subschemas,
    type_set,
)
from sgrt.constrained.schema_marks import (
    MAX_MIN_CONTAINS,
    NARROWED_KEY,
    _APPLICATORS,
    _UNSUPPORTED,
    _narrowed_member,
    relax,
)
from sgrt.errors import GrammarError

class RewriteMixin:
    """Step 3 of :class:`~sgrt.constrained.schema._Normalizer`."""

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

    def _llguidance_pattern_keys(self, node: dict, path: str) -> dict:
        """``node`` (a copy of our own) with its ``pattern`` and ``patternProperties`` keys
        through :func:`llguidance_pattern`."""

        def fix(pattern: str, where: str) -> str:
            try:
                return llguidance_pattern(pattern)
            except UnsupportedPattern as e:
                raise GrammarError(
                    f"json_schema pattern {pattern!r} at {where} is not supported: {e}", field="json_schema", path=where
                ) from None

        if isinstance(node.get("pattern"), str):
            node["pattern"] = fix(node["pattern"], f"{path}/pattern")
        if isinstance(node.get("patternProperties"), dict):
            node["patternProperties"] = {
                fix(k, f"{path}/patternProperties/{escape_pointer(k)}"): v for k, v in node["patternProperties"].items()
            }
        return node

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
            sub = dict(names) if isinstance(names, dict) else names
            if isinstance(sub, dict):
                for k in ("$defs", "definitions"):
                    if k in self.current:
                        sub[k] = self.current[k]
            validator = ecma_validator(plain_json(sub))
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
                parent = relax(node)
                for i in range(n):
                    ctx = type_set(deref(wide[i], res))
                    # alternatives of a negation that the branch or the node itself excludes hold
                    # no instance: pruned, so the backend does not build them (issue 42)
                    negs = [prune_alternatives(negate(wide[j], res, context=ctx), [wide[i], parent], res)
                            for j in range(n) if (i, j) in overlap]
                    if any(neg is False for neg in negs):
                        continue  # every instance of this branch matches another one too
                    negs = [neg for neg in negs if not _implied(neg, [wide[i], parent])]
                    expanded.append({"allOf": [branches[i], *negs]} if negs else branches[i])
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


def _implied(neg: Schema, contexts: list[Schema]) -> bool:
    """Whether every instance of all ``contexts`` satisfies ``neg`` for sure, so intersecting
    with it changes nothing. Recognized form: an alternative of ``neg`` that says "property p is
    present and its value is valid under S" (what negating a ``const`` / ``enum`` property gives),
    where the contexts make the instance an object, require p, and list its possible values
    (``const`` / ``enum``), each of which S accepts (checked with ECMA-262 patterns)."""
    alternatives = neg["anyOf"] if isinstance(neg, dict) and set(neg) == {"anyOf"} else [neg]
    dicts = [c for c in contexts if isinstance(c, dict)]
    if not any(type_set(c) == {"object"} for c in dicts):
        return False
    for alt in alternatives:
        if not isinstance(alt, dict) or set(alt) != {"type", "required", "properties"} or alt["type"] != "object":
            continue
        required, props = alt["required"], alt["properties"]
        if not (isinstance(required, list) and len(required) == 1 and isinstance(props, dict) and list(props) == required):
            continue
        name = required[0]
        if not any(name in (c.get("required") or []) for c in dicts):
            continue
        values = None
        for c in dicts:
            sub = (c.get("properties") or {}).get(name)
            if isinstance(sub, dict) and ("const" in sub or isinstance(sub.get("enum"), list)):
                listed = [sub["const"]] if "const" in sub else sub["enum"]
                values = listed if values is None else [v for v in values if any(_same(v, w) for w in listed)]
        if not values:
            continue
        try:
            validator = ecma_validator(plain_json(props[name]))
            if all(validator.is_valid(plain_json(v)) for v in values):
                return True
        except Exception:  # a schema jsonschema cannot read (a $ref out of its reach): not proved
            continue
    return False


def _same(a: Any, b: Any) -> bool:
    """JSON equality of two scalars (``True`` is not ``1``)."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    return a == b
