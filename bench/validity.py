"""Feed JSON Schema corpora through grammars token by token (used by the tests and the bench).

The corpora are ``../shared/data/jsonschemabench`` (MaskBench format: ``{"schema": ...,
"tests": [{"valid": bool, "data": ...}]}``) and ``../shared/data/json-schema-test-suite``
(draft 2020-12: ``[{"schema": ..., "tests": [...]}]``). Each instance is serialized compactly,
with object keys in the grammar's order (schema ``properties`` order), tokenized canonically and
fed one token at a time: it is accepted if every token is and the grammar accepts at the end.

A valid instance that is rejected counts as a *departure* (not an error) when it breaks one of
the generation defaults we chose: it is invalid under the normalized schema (closed objects,
string caps, formats enforced by :mod:`~sgrt.constrained.formats`).

A corpus harness, not part of the runtime: it lives in ``bench/`` (imported as ``bench.validity``
by the tests and by ``bench/schema_corpus.py``).
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jsonschema
import torch

from sgrt.constrained.bitmask import allocate_token_bitmask
from sgrt.constrained.ecma_regex import UnsupportedPattern, rust_full_match
from sgrt.constrained.ecma_regex import search as ecma_search
from sgrt.constrained.formats import FORMAT_REGEXES
from sgrt.constrained.options import GrammarOptions
from sgrt.constrained.schema import normalize_schema
from sgrt.errors import GrammarError



def _data_dir() -> Path:
    """``shared/data`` next to the checkout (``SGRT_DATA_DIR`` overrides): the nearest parent
    of this file that has one (a worktree may sit deeper than the main checkout)."""
    env = os.environ.get("SGRT_DATA_DIR")
    if env:
        return Path(env)
    for parent in Path(__file__).resolve().parents:
        if (parent / "shared" / "data").is_dir():
            return parent / "shared" / "data"
    return Path(__file__).resolve().parents[2] / "shared" / "data"


DATA_DIR = _data_dir()


@dataclass
class CorpusCase:
    """One schema and its labelled instances."""

    source: str
    name: str
    schema: Any
    tests: list[tuple[str, bool, Any]]


@dataclass
class CaseResult:
    """What happened to one schema on one backend."""

    name: str
    compiled: bool
    error: str | None = None
    compile_s: float = 0.0
    valid_accepted: int = 0
    valid_rejected: int = 0
    departures: int = 0
    invalid_rejected: int = 0
    invalid_accepted: int = 0
    mask_mismatch: int = 0
    mask_stricter: int = 0
    mask_times: list[float] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def load_maskbench(root: Path | None = None) -> list[CorpusCase]:
    """The 313 JSONSchemaBench schemas (manifest order)."""
    root = root or DATA_DIR / "jsonschemabench"
    manifest = json.loads((root / "manifest.json").read_text())
    cases = []
    for entry in manifest:
        d = json.loads((root / entry["file"]).read_text())
        tests = [(t.get("description", ""), bool(t["valid"]), t["data"]) for t in d.get("tests", [])]
        cases.append(CorpusCase("jsonschemabench", entry["file"], d["schema"], tests))
    return cases


def load_test_suite(root: Path | None = None, files: list[str] | None = None) -> list[CorpusCase]:
    """JSON Schema Test Suite draft 2020-12 groups (``files``: names like ``"anyOf.json"``;
    default: every top-level file except remote-reference ones)."""
    root = root or DATA_DIR / "json-schema-test-suite" / "draft2020-12"
    paths = [root / f for f in files] if files else sorted(p for p in root.glob("*.json") if "Remote" not in p.name)
    cases = []
    for p in paths:
        for i, group in enumerate(json.loads(p.read_text())):
            tests = [(t["description"], bool(t["valid"]), t["data"]) for t in group["tests"]]
            cases.append(CorpusCase("test-suite", f"{p.name}#{i}", group["schema"], tests))
    return cases


# How instances are written (``run_case(serialization=...)``) and the whitespace option the
# grammar is compiled with for each: compact, Python's default separators (", " and ": "), and
# pretty-printed with one space of indentation per level (flexible whitespace).
SERIALIZATIONS = {"compact": "compact", "default": "one_space", "flexible": "flexible"}


def instance_text(data: Any, schema: Any = None, serialization: str = "compact", backend: str = "llguidance") -> str:
    """JSON for ``data`` with object keys in ``schema``'s ``properties`` order and integral
    floats written as integers, in one of :data:`SERIALIZATIONS`."""
    if schema is not None:
        data = order_keys(data, schema, schema, backend=backend)
    data = _compact_numbers(data)
    if serialization == "default":
        return json.dumps(data, ensure_ascii=False)
    if serialization == "flexible":
        return json.dumps(data, indent=1, ensure_ascii=False)
    return json.dumps(data, separators=(",", ":"), ensure_ascii=False)


def _compact_numbers(data: Any) -> Any:
    """Integral floats as ints (``0.0`` -> ``0``): the same JSON number, written compactly."""
    if isinstance(data, float) and data.is_integer() and abs(data) < 1e15:
        return int(data)
    if isinstance(data, dict):
        return {k: _compact_numbers(v) for k, v in data.items()}
    if isinstance(data, list):
        return [_compact_numbers(v) for v in data]
    return data


def order_keys(data: Any, node: Any, root: Any, depth: int = 0, backend: str = "llguidance") -> Any:
    """``data`` with dict keys reordered to follow the schema's ``properties`` (best effort, as
    llguidance merges them: own ``properties``, then ``allOf`` members and ``$ref`` targets in
    order, then the first ``anyOf`` / ``oneOf`` branch that ``data`` validates against; keys
    named only in ``required`` follow, in that order)."""
    if depth > 50 or not isinstance(node, dict) or not isinstance(data, (dict, list)):
        return data
    parts = _merged_parts(node, root, data, 0, backend)
    props: dict[str, Any] = {}
    extra = None
    items = None
    prefix: list = []
    required: list[str] = []
    for part in parts:
        for k, v in (part.get("properties") or {}).items():
            props.setdefault(k, v)
        required += [k for k in part.get("required") or [] if isinstance(k, str)]
        if extra is None and isinstance(part.get("additionalProperties"), dict):
            extra = part["additionalProperties"]
        if items is None and isinstance(part.get("items"), dict):
            items = part["items"]
        if not prefix and isinstance(part.get("prefixItems"), list):
            prefix = part["prefixItems"]
    if isinstance(data, dict):
        keys = [k for k in props if k in data]
        keys += [k for k in dict.fromkeys(required) if k in data and k not in keys]
        keys += [k for k in data if k not in keys]
        return {k: order_keys(data[k], props.get(k, extra), root, depth + 1, backend) for k in keys}
    return [order_keys(v, prefix[i] if i < len(prefix) else items, root, depth + 1, backend) for i, v in enumerate(data)]


def _merged_parts(node: Any, root: Any, data: Any, depth: int, backend: str = "llguidance") -> list[dict]:
    node = _deref(node, root)
    if not isinstance(node, dict) or depth > 8:
        return []
    parts = [node]
    if "$ref" in node:
        ref_parts = _merged_parts({"$ref": node["$ref"]}, root, data, depth + 1, backend)
        keys = list(node)
        # llguidance merges a sibling $ref in the schema's key order
        if "properties" in node and keys.index("$ref") < keys.index("properties"):
            parts = ref_parts + parts
        else:
            parts += ref_parts
    for m in node.get("allOf") or []:
        parts += _merged_parts(m, root, data, depth + 1, backend)
    for key in ("anyOf", "oneOf"):
        for m in node.get(key) or []:
            if _validates(root, m, data, backend):
                parts += _merged_parts(m, root, data, depth + 1, backend)
                break
    return parts


def _validates(root: Any, schema: Any, data: Any, backend: str = "llguidance") -> bool:
    try:  # the patterns of a normalized schema are in its backend's dialect (normalized_validator)
        base = normalized_validator(root if isinstance(root, dict) else {}, backend)
        return base.evolve(schema=schema).is_valid(data)
    except Exception:
        return False


def _deref(node: Any, root: Any) -> Any:
    for _ in range(10):
        ref = node.get("$ref") if isinstance(node, dict) else None
        if isinstance(ref, str) and len([k for k in node if k not in ("description", "title")]) > 1:
            return node  # a $ref with siblings: _merged_parts follows it
        if not isinstance(ref, str) or not ref.startswith("#"):
            return node
        target = root
        for part in ref[1:].split("/")[1:]:
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(target, dict) and part in target:
                target = target[part]
            else:
                return node
        node = target
    return node


def _format_checker() -> jsonschema.FormatChecker:
    checker = jsonschema.FormatChecker(formats=())
    for name, rx in FORMAT_REGEXES.items():
        compiled = re.compile(rx)
        checker.checks(name)(lambda value, c=compiled: not isinstance(value, str) or c.fullmatch(value) is not None)
    return checker


_CHECKER = _format_checker()


def _pattern_keywords(match) -> dict:
    """jsonschema keyword functions for ``pattern``, ``patternProperties`` and
    ``additionalProperties`` whose regexes are matched with ``match(regex, text)``."""
    def pattern(validator, patrn, instance, schema):  # noqa: ANN001 (jsonschema's signature)
        if not (validator.is_type(instance, "string") and isinstance(patrn, str)):
            return
        try:
            ok = match(patrn, instance)
        except UnsupportedPattern:
            return
        if not ok:
            yield jsonschema.exceptions.ValidationError(f"{instance!r} does not match {patrn!r}")

    def matched(patrn: str, key: str) -> bool:
        try:
            return match(patrn, key)
        except UnsupportedPattern:
            return False

    def pattern_properties(validator, patterns, instance, schema):  # noqa: ANN001
        if validator.is_type(instance, "object"):
            for patrn, sub in patterns.items():
                for key, value in instance.items():
                    if matched(patrn, key):
                        yield from validator.descend(value, sub, path=key, schema_path=patrn)

    def additional_properties(validator, extra, instance, schema):  # noqa: ANN001
        if not validator.is_type(instance, "object"):
            return
        named, patterns = schema.get("properties") or {}, schema.get("patternProperties") or {}
        for key, value in instance.items():
            if key in named or any(matched(p, key) for p in patterns):
                continue
            if extra is False:
                yield jsonschema.exceptions.ValidationError(f"additional property {key!r} is not allowed",
                                                            validator="additionalProperties")
            elif isinstance(extra, dict):
                yield from validator.descend(value, extra, path=key)

    return {"pattern": pattern, "patternProperties": pattern_properties, "additionalProperties": additional_properties}


# Validators for a normalized schema: llguidance's patterns are the Rust translation sgrt
# wrote (matched by llguidance's engine), outlines' are ECMA-262 (sgrt's translation);
# Python's ``re`` would read either differently. (unevaluated* never reach a normalized schema.)
_VALIDATORS = {
    "llguidance": jsonschema.validators.extend(jsonschema.Draft202012Validator, _pattern_keywords(rust_full_match)),
    "outlines": jsonschema.validators.extend(jsonschema.Draft202012Validator, _pattern_keywords(ecma_search)),
}


def normalized_validator(schema: Any, backend: str = "llguidance", **kw: Any) -> Any:
    """A jsonschema Draft 2020-12 validator for a schema sgrt normalized for ``backend``."""
    return _VALIDATORS.get(backend, _VALIDATORS["outlines"])(schema, **kw)


def departure_reason(normalized_schema: Any, data: Any, backend: str = "llguidance") -> str | None:
    """Why ``data`` breaks the generation defaults (closed objects, string caps, formats), or
    None if it is valid under the normalized schema (``backend``'s: its patterns' dialect)."""
    try:
        validator = normalized_validator(normalized_schema, backend, format_checker=_CHECKER)
        error = jsonschema.exceptions.best_match(validator.iter_errors(data))
    except Exception:  # a schema jsonschema cannot handle: no departure claimed
        return None
    if error is None:
        return None
    return {"additionalProperties": "closed object", "maxLength": "string cap", "format": "format"}.get(
        error.validator, str(error.validator)
    )


def _all_integral_as_int(data: Any) -> Any:
    if isinstance(data, float) and data.is_integer():
        return int(data)
    if isinstance(data, dict):
        return {k: _all_integral_as_int(v) for k, v in data.items()}
    if isinstance(data, list):
        return [_all_integral_as_int(v) for v in data]
    return data


def spelling_departure(compiled: Any, vocab: Any, data: Any, normalized: Any, text: str,
                       serialization: str = "compact", backend: str = "llguidance") -> str | None:
    """``"number spelling"`` when the grammar takes the same value with every integral number
    written as an integer (``9007199254740992`` for ``9007199254740992.0``): a documented
    departure (a generator writes integers without a fraction), else None."""
    plain = instance_text(_all_integral_as_int(data), normalized, serialization, backend)
    if plain == text:
        return None
    accepted, _ = feed_tokens(compiled.new_grammar(), vocab.encode(plain))
    return "number spelling" if accepted else None


def feed_tokens(grammar: Any, token_ids: list[int], bitmask: torch.Tensor | None = None,
                times: list[float] | None = None, stricter: list[int] | None = None) -> tuple[bool, int]:
    """Feed ``token_ids``; returns (accepted and accepting at the end, mask mismatches).

    With ``bitmask`` (``[1, W]``), the mask is filled before every token, timed into ``times``,
    and checked against ``accept_token``: a token the mask allows but ``accept_token`` rejects
    is a mismatch (a bug: the engine would abort). The reverse (the mask forbids a token that
    ``accept_token`` takes) is counted in ``stricter``: llguidance masks non-canonical splits of
    forced text (e.g. ``":`` where ``":"`` is forced), which is by design.
    """
    mismatches = 0
    for t in token_ids:
        if bitmask is not None:
            t0 = time.perf_counter()
            grammar.fill_vocab_mask(bitmask, 0)
            if times is not None:
                times.append(time.perf_counter() - t0)
            allowed = bool((int(bitmask[0, t // 32]) >> (t % 32)) & 1)
        else:
            allowed = None
        ok = grammar.accept_token(t)
        if allowed and not ok:
            mismatches += 1
        elif allowed is False and ok and stricter is not None:
            stricter[0] += 1
        if not ok:
            return False, mismatches
    return grammar.is_accepting(), mismatches


def run_case(compiler: Any, backend: str, case: CorpusCase, options: GrammarOptions | None = None,
             max_tests: int | None = None, measure_masks: bool = True,
             serialization: str = "compact") -> CaseResult:
    """Compile ``case.schema`` on ``backend`` and feed every instance (see module docstring).

    ``serialization``: one of :data:`SERIALIZATIONS`; the grammar is compiled with the matching
    whitespace option (unless ``options`` is given). A compiler with ``raw_schemas = True``
    (another engine, in bench/schema_corpus.py) gets the schema as written: keys are ordered
    and departures judged on it."""
    options = options or dataclasses.replace(compiler.options, whitespace=SERIALIZATIONS[serialization])
    result = CaseResult(case.name, compiled=False)
    t0 = time.perf_counter()
    try:
        compiled = compiler.compile_spec("json_schema", case.schema, backend, options)
    except GrammarError as e:
        result.error = str(e)
        result.compile_s = time.perf_counter() - t0
        return result
    result.compile_s = time.perf_counter() - t0
    result.compiled = True
    try:
        normalized = case.schema if getattr(compiler, "raw_schemas", False) else \
            normalize_schema(case.schema, options, backend).schema
    except GrammarError:
        normalized = case.schema
    bitmask = allocate_token_bitmask(1, compiler.vocab.vocab_size) if measure_masks else None
    tests = case.tests if max_tests is None else case.tests[:max_tests]
    for desc, valid, data in tests:
        text = instance_text(data, normalized, serialization, backend)  # key order as the backend sees the schema
        grammar = compiled.new_grammar()
        stricter = [0]
        accepted, mismatches = feed_tokens(grammar, compiler.vocab.encode(text), bitmask, result.mask_times, stricter)
        result.mask_mismatch += mismatches
        result.mask_stricter += stricter[0]
        if valid and accepted:
            result.valid_accepted += 1
        elif valid:
            reason = departure_reason(normalized, data, backend) or \
                spelling_departure(compiled, compiler.vocab, data, normalized, text, serialization, backend)
            if reason is not None:
                result.departures += 1
            else:
                result.valid_rejected += 1
                result.notes.append(f"valid rejected: {desc}: {text[:200]}")
        elif accepted:
            result.invalid_accepted += 1
            result.notes.append(f"INVALID ACCEPTED: {desc}: {text[:200]}")
        else:
            result.invalid_rejected += 1
    return result
