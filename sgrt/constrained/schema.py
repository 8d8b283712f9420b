"""JSON Schema inputs -> one normalized dict that a grammar backend can compile, or a GrammarError.

Three steps, in order (:func:`normalize_schema`; steps 2 and 3 in
:mod:`~sgrt.constrained.schema_prepare` and :mod:`~sgrt.constrained.schema_rewrite`, references in
:mod:`~sgrt.constrained.schema_refs`, the shared marks in :mod:`~sgrt.constrained.schema_marks`):

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

from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from sgrt.constrained.numbers import (
    check_multiples, exact, fit_bounds, fit_values, is_number, load_exact, parse_exact, plain_json,
)
from sgrt.constrained.options import GrammarOptions
from sgrt.constrained.schema_algebra import Schema, map_subschemas, type_set
from sgrt.constrained.schema_marks import (
    _ANNOTATIONS,
    NARROWED_KEY,
    PLAIN_ESCAPES_KEY,
    _COUNT_KEYS,
    _OLD_DRAFTS,
    _spell_node,
)
from sgrt.constrained.schema_prepare import PrepareMixin
from sgrt.constrained.schema_refs import RefsMixin
from sgrt.constrained.schema_rewrite import RewriteMixin
from sgrt.errors import GrammarError
from sgrt.schema_value import schema_value

# NOTE: the marks and keyword sets live in schema_marks (the mixins share them); their public
# names stay importable from here.
from sgrt.constrained.schema_marks import (  # noqa: E402,F401
    MAX_MIN_CONTAINS, NARROWED_KEY, PLAIN_ESCAPES_KEY, mixes_named_and_free_keys, relax, strip_marks,
)


@dataclass
class NormalizedSchema:
    """A schema ready for a backend (``schema``) and the warnings collected on the way."""

    schema: Schema
    warnings: list[str] = field(default_factory=list)


def load_schema(spec: Any) -> Schema:
    """Turn a ``json_schema`` request value into a dict (or a boolean schema) of our own, with its
    numbers exact (:mod:`~sgrt.constrained.numbers`): JSON text is parsed with integers as
    ``int`` and other numbers as ``Decimal``; a dict is copied (the rewrites change it) with each
    ``float`` as the ``Decimal`` of its shortest decimal form (``0.1`` is 0.1, as ``json.dumps``
    writes it); other types as :func:`sgrt.schema_value.schema_value` reads them.

    Raises:
        GrammarError: (field ``json_schema``) invalid JSON text (``NaN`` / ``Infinity``
            included), a value that is not JSON (a non-finite number, a non-string key, another
            type), or a type we cannot read.
    """
    if isinstance(spec, (str, bytes)):
        try:
            value = parse_exact(spec)
        except ValueError as e:
            raise GrammarError(f"json_schema is not valid JSON: {e}", field="json_schema") from None
        if not isinstance(value, (dict, bool)):
            raise GrammarError("json_schema must be a JSON object or a boolean", field="json_schema")
        return value
    value = spec if isinstance(spec, dict) else schema_value(spec)
    if not isinstance(value, dict):
        return value
    try:
        return load_exact(value)
    except ValueError as e:
        raise GrammarError(f"json_schema is not JSON: {e}", field="json_schema") from None


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


# Names of the shared definitions _shared_number adds to the root's $defs.
_SHARED_PREFIX = "x-sgrt-number-"
_NUMBER_KEYS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")
# Keywords step 2a (:meth:`_upgrade`) rewrites; a document without any skips it.
_UPGRADE_KEYS = frozenset({"items", "additionalItems", "exclusiveMinimum", "exclusiveMaximum", "dependencies",
                           "uniqueItems", *_COUNT_KEYS})


def _scan(root: Schema) -> tuple[set[str], bool]:
    """Every object key anywhere in ``root`` (a JSON value), and whether it holds a Decimal."""
    keys: set[str] = set()
    has_decimal = False
    stack = [root]
    while stack:
        node = stack.pop()
        if type(node) is dict:
            keys.update(node)
            values = node.values()
        else:
            values = node
        for v in values:
            t = type(v)
            if t is dict or t is list:
                stack.append(v)
            elif t is Decimal:
                has_decimal = True
    return keys, has_decimal


class _Normalizer(RefsMixin, PrepareMixin, RewriteMixin):
    """One normalization: the steps, in :meth:`run`'s order, live in the three mixins
    (:mod:`~sgrt.constrained.schema_refs`, :mod:`~sgrt.constrained.schema_prepare`,
    :mod:`~sgrt.constrained.schema_rewrite`)."""

    def __init__(self, root: dict, options: GrammarOptions, backend: str):
        self.root = root
        self.options = options
        self.backend = backend
        self.warnings: list[str] = []
        schema_uri = root.get("$schema", "") if isinstance(root, dict) else ""
        self.old_draft = isinstance(schema_uri, str) and any(d in schema_uri for d in _OLD_DRAFTS)
        self.root_id = root.get("$id") or root.get("id") if isinstance(root, dict) else None
        self.anchors: dict[str, str] = {}
        self.keys, self.has_decimal = _scan(root) if isinstance(root, (dict, list)) else (set(), False)
        if "$anchor" in self.keys:
            self._collect_anchors(root, "")

    # ---- entry ----------------------------------------------------------------------------

    def run(self) -> Schema:
        keys = self.keys
        # Passes whose keywords occur nowhere in the document are skipped (``keys`` holds every
        # object key of the document, property names included: a superset, so a skip is safe).
        upgraded = self._upgrade(self.root, "") if self.old_draft or keys & _UPGRADE_KEYS else self.root
        upgraded = self._localize_refs(upgraded) if "$id" in keys else upgraded
        self.upgraded = upgraded
        closing = self.options.additional_properties_default == "closed" and "properties" in keys
        keep_open = self._composed_paths(upgraded) if closing else None
        with_options = self._apply_options(upgraded, "", keep_open, negated=False)
        if keys & {"unevaluatedProperties", "unevaluatedItems"}:
            with_options = self._resolve_unevaluated(with_options, "", with_options)
        self.current = with_options
        self._rewritten: dict[str, Schema] = {}
        out = self._rewrite(with_options, "")
        if keys & {"contains", "minContains", "maxContains"}:
            out = self._rewrite_contains(out, "", in_one_of=False)
        if self.backend == "llguidance":
            self._uses_multiple_of = "multipleOf" in keys
            self._free_keys = False
            self._shared: dict[str, Schema] = {}
            self._shared_names: dict[str, str] = {}
            self._in_resource = 0
            self._multiples: list[tuple[str, Any]] = []
            out = self._finish_llguidance(out, "")
            check_multiples(self._multiples)
            if self._shared:  # number schemas defined once (see _shared_number)
                out = {**out, "$defs": {**(out.get("$defs") or {}), **self._shared}}
            if isinstance(out, dict) and self._free_keys:
                out = {**out, PLAIN_ESCAPES_KEY: True}
        else:
            out = self._values_final(out, "")
        return plain_json(out) if self.has_decimal else out

    def _shared_number(self, node: dict) -> Schema | None:
        """``{"$ref": ...}`` to one shared definition of ``node``'s number part, when ``node``
        (finished: the default caps added, bounds fitted) holds nothing but a numeric ``type``
        (other types stay inline beside the reference, in an ``anyOf``), number keywords and
        annotations; else None. llguidance builds a bounded number lexeme per occurrence (~0.4
        ms each with the default +-10^15 bounds, and an ``anyOf`` spread over an object
        multiplies the occurrences) but a ``$ref`` target once: ten such properties compiled in
        4.4 ms inline, 0.9 ms shared. Equal number schemas share one definition."""
        types = node.get("type")
        types = [types] if isinstance(types, str) else types
        if not isinstance(types, list) or not any(k in node for k in _NUMBER_KEYS) or self._in_resource:
            return None
        numeric = [t for t in types if t in ("number", "integer")]
        if not numeric or any(k not in _ANNOTATIONS and k not in _NUMBER_KEYS for k in node if k != "type"):
            return None
        part = {"type": "number" if "number" in numeric else "integer",
                **{k: node[k] for k in _NUMBER_KEYS if k in node}}
        key = repr(part)
        name = self._shared_names.get(key)
        if name is None:
            name = f"{_SHARED_PREFIX}{len(self._shared_names)}"
            if isinstance(self.root, dict) and name in (self.root.get("$defs") or {}):
                return None  # the user's own definition has that name: keep this one inline
            self._shared_names[key] = name
            self._shared[name] = part
        ref = {"$ref": f"#/$defs/{name}"}
        others = [t for t in types if t not in ("number", "integer")]
        return {"anyOf": [ref, {"type": others}]} if others else ref

    def _values_final(self, node: Schema, path: str) -> Schema:
        """Marks dropped and every ``const`` / ``enum`` written for a backend that reads numbers
        as doubles (:func:`~sgrt.constrained.numbers.fit_values`), in one walk."""
        if not isinstance(node, dict):
            return node
        node = {k: v for k, v in node.items() if k != NARROWED_KEY}
        node = fit_values(node, path, self.warnings)
        return map_subschemas(node, self._values_final, path)

    def _finish_llguidance(self, node: Schema, path: str) -> Schema:
        """The last walk for llguidance, over the whole rewritten tree (where no ``not``,
        ``if``, ``propertyNames`` or ``contains`` is left: every position is positive), one node
        at a time: our marks dropped; the default number bounds (:meth:`_bound_number`), equal
        capped number schemas shared (:meth:`_shared_number`);
        object ``const`` / ``enum`` spelled as properties (:func:`_spell_node`); numbers written
        so llguidance reads their exact values (:func:`~sgrt.constrained.numbers.fit_values` /
        :func:`~sgrt.constrained.numbers.fit_bounds`); patterns translated
        (:meth:`_llguidance_pattern_keys`); and whether an object mixes named and free keys
        (``self._free_keys``, see :data:`PLAIN_ESCAPES_KEY`)."""
        if not isinstance(node, dict):
            return node
        node = {k: v for k, v in node.items() if k != NARROWED_KEY}
        capped = False
        if "type" in node and not ("enum" in node or "const" in node):
            ts = type_set({"type": node["type"]})
            if ts is not None and ts & {"number", "integer"}:
                capped = self._bound_number(node, ts)
        node = _spell_node(node)
        node = fit_values(node, path, self.warnings)
        if any(k in node for k in _NUMBER_KEYS):
            ts = type_set({"type": node["type"]}) if "type" in node else None
            if "multipleOf" in node and is_number(node["multipleOf"]):
                self._multiples.append((f"{path}/multipleOf", exact(node["multipleOf"])))
            node = fit_bounds(node, path, integer=ts == {"integer"})
            shared = self._shared_number(node) if capped else None
            if shared is not None:
                return shared
        if "pattern" in node or "patternProperties" in node:
            node = self._llguidance_pattern_keys(node, path)
        if not self._free_keys and (node.get("properties") or node.get("patternProperties")) \
                and node.get("additionalProperties", True) is not False:
            self._free_keys = True
        # Below an embedded resource (a nested draft-04 "id" left as written), "#/$defs/..."
        # would resolve against that resource: no shared definitions there.
        nested = bool(path) and (isinstance(node.get("$id"), str) or isinstance(node.get("id"), str))
        self._in_resource += nested
        try:
            return map_subschemas(node, self._finish_llguidance, path)
        finally:
            self._in_resource -= nested
