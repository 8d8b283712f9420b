"""Size and depth limits a constraint must meet before any native grammar code sees it.

llguidance compiles JSON Schemas and Lark grammars by recursion: each level of a ``$ref`` chain
through ``$defs`` costs ~9 KB of native stack (an object whose property is a ``$ref``) and each
link of a chain of Lark rules ~3.3 KB, so a ~100 KB request overflows an 8 MB thread stack and
kills the process (SIGSEGV, no Python exception). Nested bounded repeats in a regex blow up its
derivative-based lexer (``(a{1000}){1000}``: the lexer runs out of states mid-generation, after
the mask allowed a token). :class:`GrammarLimits` bounds every input dimension that drives those
costs; the ``check_*`` functions walk the input iteratively (no Python recursion, so a deep
input cannot raise ``RecursionError`` either) and raise :class:`~sgrt.errors.GrammarError` naming
the limit and the value. Measured figures and the reasoning behind the defaults: DESIGN.md
("Grammar compile limits and isolation").

The same object carries llguidance's own parser limits (:meth:`GrammarLimits.llguidance_limits`,
llguidance 1.9 ``LLParserLimits``), set explicitly rather than left to the library's defaults.
"""
from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, fields
from typing import Any

from sgrt.errors import GrammarError

_QUANT = re.compile(r"\{(\d+)(,(\d*))?\}")
_LARK_RULE = re.compile(r"^\s*[?!]?[A-Za-z_][A-Za-z_0-9]*(\.-?\d+)?\s*:", re.MULTILINE)
_LARK_REPEAT = re.compile(r"\{\s*(\d+)\s*(,\s*(\d*)\s*)?\}")


@dataclass(frozen=True)
class GrammarLimits:
    """Limits on constraints, checked before compilation (sizes in bytes of UTF-8 text).

    Attributes:
        max_schema_bytes: size of a JSON Schema as compact JSON text.
        max_schema_depth: nesting of objects and arrays along any path of the schema document,
            a ``$ref`` followed as one more level into its target (recursion through a cycle
            counts once).
        max_ref_depth: ``$ref`` hops along any path, cycles counted once.
        max_definitions: entries of ``$defs`` and ``definitions``, summed over the schema.
        max_properties: entries of ``properties``, summed over the schema.
        max_grammar_bytes: size of a Lark grammar's text.
        max_grammar_rules: rules and terminals defined by a Lark grammar.
        max_regex_bytes: size of a regex (a ``regex`` constraint or a schema ``pattern``).
        max_repeat: the largest bound of one counted repetition ``{n}``, ``{n,m}``, ``{n,}``
            (regex or Lark).
        max_repeat_product: the product of the bounds of nested counted repetitions in a regex
            (``(a{1,50}){1,50}``: 2,500).
        compile_stack_mb: stack of the thread that runs a native compilation (MiB).
        llguidance_*: llguidance's ``LLParserLimits`` (see its documentation): the largest
            grammar row, lexer fuel to build and per mask step, Earley items per step, lexer
            states, and grammar symbols.

    Raises:
        GrammarError: (field named after the attribute) a limit is not a positive int.
    """

    max_schema_bytes: int = 128 * 1024
    max_schema_depth: int = 128
    max_ref_depth: int = 64
    max_definitions: int = 1000
    max_properties: int = 2000
    max_grammar_bytes: int = 64 * 1024
    max_grammar_rules: int = 1000
    max_regex_bytes: int = 16 * 1024
    max_repeat: int = 10_000
    max_repeat_product: int = 2000
    compile_stack_mb: int = 64
    llguidance_max_items_in_row: int = 2000
    llguidance_initial_lexer_fuel: int = 1_000_000
    llguidance_step_lexer_fuel: int = 200_000
    llguidance_step_max_items: int = 50_000
    llguidance_max_lexer_states: int = 250_000
    llguidance_max_grammar_size: int = 500_000

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise GrammarError(f"grammar limit {f.name} must be an int >= 1, got {value!r}", field=f.name)

    @classmethod
    def from_dict(cls, values: dict[str, Any] | None) -> "GrammarLimits":
        """Defaults overridden by ``values`` (unknown names raise GrammarError)."""
        values = dict(values or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise GrammarError(f"unknown grammar limit(s) {unknown}; known: {sorted(known)}", field=unknown[0])
        return cls(**values)

    def as_dict(self) -> dict[str, int]:
        return asdict(self)

    def llguidance_limits(self) -> Any:
        """These limits as ``llguidance.LLParserLimits`` (verbose errors off: parser state stays
        out of error messages that reach clients)."""
        import llguidance

        return llguidance.LLParserLimits(
            max_items_in_row=self.llguidance_max_items_in_row,
            initial_lexer_fuel=self.llguidance_initial_lexer_fuel,
            step_lexer_fuel=self.llguidance_step_lexer_fuel,
            step_max_items=self.llguidance_step_max_items,
            max_lexer_states=self.llguidance_max_lexer_states,
            max_grammar_size=self.llguidance_max_grammar_size,
            verbose_errors=False,
        )


def _refuse(field: str, what: str, value: int, limit_name: str, limit: int, path: str | None = None) -> GrammarError:
    where = f" at {path}" if path else ""
    return GrammarError(f"{field}: {what} {value}{where} exceeds the limit {limit_name}={limit}", field=field, path=path)


# ---- JSON Schema ------------------------------------------------------------------------------

def check_schema_spec(spec: Any, limits: GrammarLimits) -> None:
    """Cheap checks of a raw ``json_schema`` value before it is parsed or copied: the text's
    size and bracket depth (JSON text), or the nesting depth (a dict). Iterative.

    Raises:
        GrammarError: ``max_schema_bytes`` or ``max_schema_depth`` exceeded.
    """
    if isinstance(spec, bytes):
        spec = spec.decode("utf-8", errors="replace")
    if isinstance(spec, str):
        size = len(spec.encode("utf-8"))
        if size > limits.max_schema_bytes:
            raise _refuse("json_schema", "size (bytes)", size, "max_schema_bytes", limits.max_schema_bytes)
        depth = _text_depth(spec)
        if depth > limits.max_schema_depth:
            raise _refuse("json_schema", "nesting depth", depth, "max_schema_depth", limits.max_schema_depth)
    elif isinstance(spec, (dict, list)):
        depth = _tree_depth(spec, limits.max_schema_depth + 1)
        if depth > limits.max_schema_depth:
            raise _refuse("json_schema", "nesting depth", depth, "max_schema_depth", limits.max_schema_depth)


def check_schema(schema: Any, limits: GrammarLimits, spec_checked: bool = False) -> None:
    """All schema limits on a loaded schema (a dict or bool): size, depth following ``$ref``,
    ``$ref`` chain depth, definitions, properties, and each ``pattern`` as a regex.
    ``spec_checked``: :func:`check_schema_spec` already passed on the value this one was loaded
    from (so it holds no cycle), and its depth walk is not repeated.

    Raises:
        GrammarError: (field ``json_schema``) naming the limit, the value and, where one node is
            to blame, its JSON pointer.
    """
    if not isinstance(schema, dict):
        return
    if not spec_checked:
        check_schema_spec(schema, limits)
    try:
        size = len(json.dumps(schema, separators=(",", ":"), default=str).encode("utf-8"))
    except (ValueError, TypeError, RecursionError) as e:  # circular Python object
        raise GrammarError(f"json_schema cannot be serialized: {type(e).__name__}", field="json_schema") from None
    if size > limits.max_schema_bytes:
        raise _refuse("json_schema", "size (bytes)", size, "max_schema_bytes", limits.max_schema_bytes)
    n_defs = n_props = 0
    stack: list[tuple[Any, str]] = [(schema, "")]
    while stack:
        node, path = stack.pop()
        if isinstance(node, dict):
            for key in ("$defs", "definitions"):
                if isinstance(node.get(key), dict):
                    n_defs += len(node[key])
            if isinstance(node.get("properties"), dict):
                n_props += len(node["properties"])
            if isinstance(node.get("pattern"), str):
                check_regex(node["pattern"], limits, field="json_schema", path=f"{path}/pattern")
            if isinstance(node.get("patternProperties"), dict):
                for key in node["patternProperties"]:
                    check_regex(key, limits, field="json_schema", path=f"{path}/patternProperties")
            stack.extend((v, f"{path}/{_escape(k)}") for k, v in node.items())
        elif isinstance(node, list):
            stack.extend((v, f"{path}/{i}") for i, v in enumerate(node))
    if n_defs > limits.max_definitions:
        raise _refuse("json_schema", "number of $defs/definitions", n_defs, "max_definitions", limits.max_definitions)
    if n_props > limits.max_properties:
        raise _refuse("json_schema", "number of properties", n_props, "max_properties", limits.max_properties)
    depth, refs = _ref_depths(schema)
    if refs > limits.max_ref_depth:
        raise _refuse("json_schema", "$ref chain depth", refs, "max_ref_depth", limits.max_ref_depth)
    if depth > limits.max_schema_depth:
        raise _refuse("json_schema", "nesting depth (following $ref)", depth, "max_schema_depth",
                      limits.max_schema_depth)


def check_schema_depth(schema: Any, max_depth: int) -> None:
    """The nesting depth of ``schema`` (a dict or bool without cycles, e.g. the normalizer's
    output), following ``$ref``, against ``max_depth``.

    Raises:
        GrammarError: (field ``json_schema``) naming the depth and the limit.
    """
    if not isinstance(schema, dict):
        return
    depth, _ = _ref_depths(schema)
    if depth > max_depth:
        raise _refuse("json_schema", "nesting depth (following $ref) of the rewritten schema", depth,
                      "2 x max_schema_depth", max_depth)


def _escape(key: Any) -> str:
    return str(key).replace("~", "~0").replace("/", "~1")


def _text_depth(text: str) -> int:
    """Deepest bracket nesting of JSON text, ignoring brackets inside strings."""
    depth = best = 0
    in_str = esc = False
    for ch in text:
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch in "[{":
            depth += 1
            best = max(best, depth)
        elif ch in "]}":
            depth -= 1
    return best


def _tree_depth(root: Any, stop: int) -> int:
    """Nesting depth of dicts and lists (``stop`` once it reaches ``stop``, or for a Python
    object that contains itself); iterative. A sub-object shared by several parents (our schema
    rewrites share them) is measured once: a shared node is no cycle."""
    height: dict[int, int] = {}  # id -> height of a finished subtree
    on_path: set[int] = set()
    stack: list[tuple[Any, bool]] = [(root, False)]
    while stack:
        node, leaving = stack.pop()
        key = id(node)
        kids = [c for c in (node.values() if isinstance(node, dict) else node) if isinstance(c, (dict, list))]
        if leaving:
            on_path.discard(key)
            height[key] = 1 + max((height[id(c)] for c in kids), default=0)
            if height[key] >= stop:
                return stop
            continue
        if key in height:
            continue
        if key in on_path or len(on_path) + 1 >= stop:
            return stop
        on_path.add(key)
        stack.append((node, True))
        stack.extend((c, False) for c in kids if id(c) not in height)
    return min(height[id(root)], stop)


def _resolve(root: dict, ref: str) -> Any:
    """The target of a local ``$ref`` ("#", "#/json/pointer"), or None if not local/resolvable."""
    if ref == "#":
        return root
    if not ref.startswith("#/"):
        return None
    node: Any = root
    for part in ref[2:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _ref_depths(root: dict) -> tuple[int, int]:
    """(longest nesting, most ``$ref`` hops) over
    paths of the schema that follow local ``$ref`` into their targets; an edge back into the
    path (recursion) ends it. Iterative post-order DFS, memoized per node."""
    memo: dict[int, tuple[int, int]] = {}
    on_path: set[int] = set()
    # frame: [node, path, children iterator, best depth, best refs, (flag of the child entered)]
    stack: list[list[Any]] = [[root, "", None, 0, 0]]
    result = (0, 0)
    while stack:
        frame = stack[-1]
        node, path = frame[0], frame[1]
        if frame[2] is None:
            on_path.add(id(node))
            kids: list[tuple[Any, str, int]] = []
            if isinstance(node, dict):
                for k, v in node.items():
                    if isinstance(v, (dict, list)):
                        kids.append((v, f"{path}/{_escape(k)}", 0))
                ref = node.get("$ref")
                if isinstance(ref, str):
                    target = _resolve(root, ref)
                    if isinstance(target, (dict, list)):
                        kids.append((target, ref[1:] or "", 1))
            else:
                kids = [(v, f"{path}/{i}", 0) for i, v in enumerate(node) if isinstance(v, (dict, list))]
            frame[2] = iter(kids)
        advanced = False
        for child, cpath, is_ref in frame[2]:
            cid = id(child)
            if cid in on_path:
                continue
            if cid in memo:
                d, r = memo[cid]
                frame[3] = max(frame[3], d)
                frame[4] = max(frame[4], r + is_ref)
                continue
            frame.append(is_ref)
            stack.append([child, cpath, None, 0, 0])
            advanced = True
            break
        if advanced:
            continue
        on_path.discard(id(node))
        value = (frame[3] + 1, frame[4])
        memo[id(node)] = value
        stack.pop()
        if not stack:
            result = value
            break
        parent = stack[-1]
        is_ref = parent.pop()  # the flag pushed when this child was entered
        parent[3] = max(parent[3], value[0])
        parent[4] = max(parent[4], value[1] + is_ref)
    return result[0], result[1]


# ---- regex ------------------------------------------------------------------------------------

def check_regex(regex: str, limits: GrammarLimits, field: str = "regex", path: str | None = None) -> None:
    """Size and counted-repetition limits of one regex (Rust ``regex`` / llguidance syntax).

    Raises:
        GrammarError: ``max_regex_bytes``, ``max_repeat`` or ``max_repeat_product`` exceeded.
    """
    size = len(regex.encode("utf-8"))
    if size > limits.max_regex_bytes:
        raise _refuse(field, "regex size (bytes)", size, "max_regex_bytes", limits.max_regex_bytes, path)
    bound, product = regex_repeats(regex)
    if bound > limits.max_repeat:
        raise _refuse(field, "regex repetition bound", bound, "max_repeat", limits.max_repeat, path)
    if product > limits.max_repeat_product:
        raise _refuse(field, "product of nested regex repetition bounds", product, "max_repeat_product",
                      limits.max_repeat_product, path)


def regex_repeats(regex: str) -> tuple[int, int]:
    """(largest single counted-repetition bound, largest product of nested counted bounds) of a
    regex; 0 / 1 when there are none. ``*``, ``+`` and ``?`` count as no bound (a loop costs
    the lexer nothing per iteration); ``{n,}`` counts ``n``. A single level is not a product:
    ``a{500}`` gives (500, 1), ``(a{2,50}b){3,40}`` gives (50, 2000)."""
    biggest = 0
    # Each open group: the largest nested-bound product of the atoms in it so far.
    groups: list[int] = [1]
    last: int | None = None  # product of the atom just closed (None: nothing to quantify)
    nested_best = 1
    i, n = 0, len(regex)
    while i < n:
        ch = regex[i]
        if ch == "\\":
            i += 2
            if i - 1 < n and regex[i - 1] in "pPxu" and i < n and regex[i] == "{":
                close = regex.find("}", i)
                i = n if close < 0 else close + 1
            last = 1
            continue
        if ch == "[":
            i = _skip_class(regex, i)
            last = 1
            continue
        if ch == "(":
            groups.append(1)
            last = None
            i += 1
            continue
        if ch == ")":
            inner = groups.pop() if len(groups) > 1 else 1
            groups[-1] = max(groups[-1], inner)
            last = inner
            i += 1
            continue
        if ch == "{":
            m = _QUANT.match(regex, i)
            if m and last is not None:
                lo = int(m.group(1))
                hi = int(m.group(3)) if m.group(3) else lo
                bound = max(lo, hi, 1)
                biggest = max(biggest, bound)
                product = last * bound
                if last > 1:  # the atom already holds a counted repeat: nested
                    nested_best = max(nested_best, product)
                groups[-1] = max(groups[-1], product)
                last = product
                i = m.end()
                continue
        if ch in "*+?|":
            if ch == "|":
                last = None
            i += 1
            continue
        last = 1
        groups[-1] = max(groups[-1], 1)
        i += 1
    return biggest, nested_best


def _skip_class(regex: str, i: int) -> int:
    """Index just past the character class opening at ``regex[i] == "["`` (nested classes,
    escapes and a leading ``]`` handled)."""
    depth = 0
    j = i
    n = len(regex)
    while j < n:
        c = regex[j]
        if c == "\\":
            j += 2
            continue
        if c == "[":
            depth += 1
            j += 1
            if j < n and regex[j] == "^":
                j += 1
            if j < n and regex[j] == "]":
                j += 1
            continue
        if c == "]":
            depth -= 1
            j += 1
            if depth == 0:
                return j
            continue
        j += 1
    return n


# ---- Lark -------------------------------------------------------------------------------------

def check_lark(text: str, limits: GrammarLimits) -> None:
    """Size, rule count and repetition bounds of a Lark grammar; its ``/regex/`` terminals are
    checked as regexes and its ``%json`` schemas as schemas.

    Raises:
        GrammarError: (field ``grammar``) ``max_grammar_bytes``, ``max_grammar_rules``,
            ``max_repeat`` or a regex limit exceeded.
    """
    size = len(text.encode("utf-8"))
    if size > limits.max_grammar_bytes:
        raise _refuse("grammar", "size (bytes)", size, "max_grammar_bytes", limits.max_grammar_bytes)
    rules = len(_LARK_RULE.findall(text))
    if rules > limits.max_grammar_rules:
        raise _refuse("grammar", "number of rules", rules, "max_grammar_rules", limits.max_grammar_rules)
    for m in _LARK_REPEAT.finditer(text):
        bound = max(int(m.group(1)), int(m.group(3) or 0))
        if bound > limits.max_repeat:
            raise _refuse("grammar", "repetition bound", bound, "max_repeat", limits.max_repeat)
    for m in re.finditer(r"(?<![\w\"])/((?:[^/\\\n]|\\.)+)/[imsux]*", text):
        check_regex(m.group(1), limits, field="grammar")
    decoder = json.JSONDecoder()
    for m in re.finditer(r"%json\s*", text):
        # An embedded JSON Schema (tool calls are written this way): the schema limits apply.
        start = m.end()
        try:
            schema, _ = decoder.raw_decode(text, start)
        except RecursionError:
            raise _refuse("grammar", "%json schema nesting depth", _text_depth(text[start:]), "max_schema_depth",
                          limits.max_schema_depth) from None
        except ValueError:
            continue  # not JSON: llguidance reports it
        try:
            check_schema(schema, limits)
        except GrammarError as e:
            raise GrammarError(f"grammar: %json schema: {str(e).split(': ', 1)[-1]}", field="grammar") from None
