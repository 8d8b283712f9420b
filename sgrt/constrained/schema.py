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

import copy
import json
from dataclasses import dataclass, field
from typing import Any

from sgrt.constrained.options import GrammarOptions
from sgrt.constrained.schema_algebra import Schema
from sgrt.constrained.schema_marks import (
    PLAIN_ESCAPES_KEY,
    _OLD_DRAFTS,
    _spell_values,
    mixes_named_and_free_keys,
    strip_marks,
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
