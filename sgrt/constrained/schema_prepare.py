"""The normalizer's step 2 (:mod:`sgrt.constrained.schema`): older drafts upgraded (2a), the
objects that composition keeps open found (2b), the generation options applied (2c), the
``unevaluated*`` keywords resolved and numbers bounded (2d)."""
from __future__ import annotations

from decimal import Decimal

from sgrt.constrained.numbers import is_integral, is_number
from sgrt.constrained.formats import FORMAT_REGEXES, KNOWN_FORMATS, LLGUIDANCE_OVERRIDES
from sgrt.constrained.options import GrammarOptions
from sgrt.constrained.schema_algebra import (
    Schema,
    constraining_keys,
    declares_keys,
    map_subschemas,
    subschemas,
    type_set,
)
from sgrt.constrained.schema_marks import (
    NARROWED_KEY,
    _ANNOTATIONS,
    _APPLICATORS,
    _COUNT_KEYS,
    _Evaluated,
    _is_num,
    _mark_narrowed,
    relax,
)
from sgrt.errors import GrammarError

class PrepareMixin:
    """Step 2 of :class:`~sgrt.constrained.schema._Normalizer`."""

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
            if is_number(node.get(k)) and not isinstance(node[k], int) and is_integral(node[k]):
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

    def _bound_number(self, node: dict, ts: set[str]) -> bool:
        """Default digit bounds (see GrammarOptions.max_integer_digits) on one number schema of
        the rewritten tree, on the sides it leaves open, in place. Added after the rewrites so
        that negations (``not``, ``if``, ``oneOf``) see the user's schema, not our bounds.
        |x| < 10**digits is written as exclusive bounds at +-10**digits for numbers (llguidance
        compiles them 2-3x faster than +-(10**digits - 1), whose digit-range regex it
        intersects with ``multipleOf``) and as ``minimum`` / ``maximum`` +-(10**digits - 1) for
        integers (the same integer range either way). Returns whether it added any bound."""
        digits = self.options.max_integer_digits
        added = False
        if digits is not None:
            limit = 10**digits - 1
            integer = ts == {"integer"}
            lows = [node[k] for k in ("minimum", "exclusiveMinimum") if _is_num(node.get(k))]
            highs = [node[k] for k in ("maximum", "exclusiveMaximum") if _is_num(node.get(k))]
            if not highs and all(lo < limit for lo in lows):
                node["maximum" if integer else "exclusiveMaximum"] = limit if integer else limit + 1
                added = True
            if not lows and all(hi > -limit for hi in highs):
                node["minimum" if integer else "exclusiveMinimum"] = -limit if integer else -(limit + 1)
                added = True
        frac = self.options.max_fraction_digits
        # llguidance does not intersect two multipleOf (allOf members, $ref siblings): a schema
        # that uses multipleOf anywhere keeps its own.
        if frac is not None and "number" in ts and not self._uses_multiple_of:
            node["multipleOf"] = Decimal(f"1e-{frac}")
            added = True
        return added
