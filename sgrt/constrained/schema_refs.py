"""The normalizer's references step (:mod:`sgrt.constrained.schema`): embedded resources made
local (``$ref`` -> ``#/pointer``), anchors collected, pointers looked up."""
from __future__ import annotations

from typing import Any
from urllib.parse import urldefrag, urljoin

from sgrt.constrained.schema_algebra import Schema, map_subschemas, subschemas, unescape_pointer
from sgrt.constrained.schema_marks import _ROOT_BASE
from sgrt.errors import GrammarError

class RefsMixin:
    """References: the part of :class:`~sgrt.constrained.schema._Normalizer` that resolves them."""

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
