"""JSON Schema numbers compared as mathematical values, and written so llguidance reads them exactly.

JSON Schema 2020-12 (validation, section 6.2 and 6.1.3) compares numbers by value: ``1e2`` and
``100`` are equal, ``9007199254740993`` is neither ``9007199254740992`` nor a double. sgrt keeps
every number of a schema as an ``int`` or a :class:`~decimal.Decimal` while it normalizes
(:func:`load_exact` / :func:`parse_exact`: JSON text through ``parse_float=Decimal``, a Python
``float`` as the shortest decimal that names it, which is how ``json.dumps`` writes it), so its
own decisions (bounds, ``const`` / ``enum``, negations, disjointness) are exact.

llguidance 1.9 (``parser/src/json/schema.rs``, ``numeric.rs``) reads every bound, ``const`` and
``enum`` number and ``multipleOf`` as a double, and builds its number regexes from the double's
shortest decimal form (Rust's ``Display``), integer bounds through ``ceil`` / ``floor`` to i64.
A number ``v`` therefore reaches it unchanged exactly when the shortest decimal of
``float(v)`` has the value ``v`` (:func:`float_literal`). :func:`fit_for_llguidance` writes each
number of a normalized schema so: exact ones as they are; a bound that no double names exactly
is moved inward to the nearest one that does (a sound narrowing: only valid values between the
two are lost); a ``const`` / ``enum`` member that no double names is dropped (the rest of the
enum stays; none left is a :class:`~sgrt.errors.GrammarError` at its pointer); a ``multipleOf``
llguidance would read as another value is refused at its pointer.
"""
from __future__ import annotations

import json
import math
from decimal import Decimal, InvalidOperation
from typing import Any

from sgrt.errors import GrammarError

#: The largest bound magnitude passed to llguidance (2**63 - 1024): it turns integer bounds into
#: i64 (the doubles next to 2**63 are 1,024 apart) and parses a number bound's integer part as
#: i64. Past it a bound was clamped (a minimum of 1e19 gave 9223372036854775807) or crashed the
#: process (both bounds below -2**63, llguidance 1.9.1).
BOUND_LIMIT = 2**63 - 1024

_BOUNDS = ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum")
_NUMBER_TYPES = (int, float, Decimal)


def is_number(v: Any) -> bool:
    """Whether ``v`` is a JSON number as sgrt holds one (``int``, ``float`` or ``Decimal``; not
    ``bool``)."""
    return isinstance(v, _NUMBER_TYPES) and not isinstance(v, bool)


def exact(v: int | float | Decimal) -> int | Decimal:
    """The mathematical value of a JSON number: an ``int`` as it is, a ``float`` as the shortest
    decimal that names it (``0.1`` is 0.1, as JSON text writes it), a ``Decimal`` as it is."""
    if isinstance(v, float):
        return Decimal(repr(v))
    return v


def is_integral(v: int | float | Decimal) -> bool:
    """Whether a JSON number's value is an integer (``2.0`` is: JSON Schema 2020-12, 4.2.2)."""
    if isinstance(v, int):
        return True
    if isinstance(v, float):
        return v.is_integer()
    return v == v.to_integral_value()


def parse_exact(text: str | bytes) -> Any:
    """JSON text with its numbers kept exact: integers as ``int``, the rest as ``Decimal``.

    Raises:
        ValueError: not JSON (``json.JSONDecodeError``), or ``NaN`` / ``Infinity``, which are
            not JSON numbers (RFC 8259, section 6) though Python's parser takes them.
    """
    def constant(name: str) -> Any:
        raise ValueError(f"{name} is not a JSON number")

    return json.loads(text, parse_float=Decimal, parse_constant=constant)


def load_exact(value: Any, memo: dict[int, Any] | None = None) -> Any:
    """A copy of a JSON-like Python value (dict, list / tuple, str, int, float, Decimal, bool,
    None) with every ``float`` as :func:`exact`'s ``Decimal``. Objects shared inside ``value``
    stay shared in the copy (``memo``), so a DAG does not grow into a tree.

    Raises:
        ValueError: a non-finite number, a non-string key, or a value of another type.
    """
    memo = {} if memo is None else memo
    if isinstance(value, str) or value is None or isinstance(value, (bool, int)):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{value!r} is not a JSON number")
        return Decimal(repr(value))
    if isinstance(value, Decimal):
        if not value.is_finite():
            raise ValueError(f"{value!r} is not a JSON number")
        return value
    key = id(value)
    if key in memo:
        return memo[key]
    if isinstance(value, dict):
        out: dict = {}
        memo[key] = out
        for k, v in value.items():
            if not isinstance(k, str):
                raise ValueError(f"object key {k!r} is not a string")
            out[k] = load_exact(v, memo)
        return out
    if isinstance(value, (list, tuple)):
        items: list = []
        memo[key] = items
        items.extend(load_exact(v, memo) for v in value)
        return items
    raise ValueError(f"a {type(value).__name__} is not a JSON value")


def float_literal(v: int | float | Decimal) -> float | None:
    """The double whose shortest decimal form has exactly the value ``v``, or None if there is
    none (``2**53 + 1``, ``0.1000000000000000000001``, ``1e400``)."""
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    try:
        f = float(v)
    except (OverflowError, InvalidOperation):
        return None
    if not math.isfinite(f):
        return None
    if isinstance(v, int):
        return f if f == v else None
    return f if Decimal(repr(f)) == v else None


def _inward_double(v: int | Decimal, up: bool) -> float:
    """The double nearest ``v`` on the side ``up`` (above if True) whose shortest decimal lies on
    that side of ``v`` or at it: a bound moved inward by less than one double's step."""
    f = float(v)
    direction = math.inf if up else -math.inf
    for _ in range(4):  # the nearest double, or its neighbour, always qualifies
        value = Decimal(repr(f))
        if (value >= v) if up else (value <= v):
            return f
        f = math.nextafter(f, direction)
    raise AssertionError(f"no double found next to {v}")


def _llguidance_multiple(f: float) -> Decimal | None:
    """The value llguidance 1.9 reads for ``multipleOf: f`` (its ``Decimal::try_from(f64)``:
    multiply by 10 until the fraction is zero, at most u32 digits), or None where it refuses."""
    value, exp = abs(f), 0
    while value - math.trunc(value) != 0.0:
        value *= 10.0
        exp += 1
        if exp > 400:
            return None
    if value > 2**32 - 1:
        return None
    return Decimal(int(value)).scaleb(-exp)


def _fail(path: str, key: str, why: str) -> GrammarError:
    return GrammarError(f"json_schema {key} at {path or '/'}: {why}", field="json_schema", path=f"{path}/{key}")


def _literal_value(v: Any) -> tuple[bool, Any]:
    """``(exact, value)`` of a ``const`` / ``enum`` member for llguidance: numbers (also inside
    arrays and objects) as :func:`float_literal` doubles or ints; ``exact`` False if one has no
    double of its own value."""
    if is_number(v):
        if isinstance(v, int):
            return (float_literal(v) is not None and abs(v) <= BOUND_LIMIT), v
        f = float_literal(v)
        if f is None or abs(f) > BOUND_LIMIT:
            return False, v
        return True, int(f) if is_integral(v) and f.is_integer() else f
    if isinstance(v, list):
        parts = [_literal_value(x) for x in v]
        return all(ok for ok, _ in parts), [x for _, x in parts]
    if isinstance(v, dict):
        parts2 = {k: _literal_value(x) for k, x in v.items()}
        return all(ok for ok, _ in parts2.values()), {k: x for k, (_, x) in parts2.items()}
    return True, v


def fit_values(node: dict, path: str, warnings: list[str]) -> dict:
    """``node`` with its ``const`` / ``enum`` numbers written for a double-reading backend (see
    the module docstring), members that no double names dropped with a warning.

    Raises:
        GrammarError: (``path`` the keyword's pointer) a ``const``, or every ``enum`` member,
            holds a number no double names exactly.
    """
    if "const" in node:
        ok, value = _literal_value(node["const"])
        if not ok:
            raise _fail(path, "const", f"{_short(node['const'])} holds a number that the grammar engine reads as a "
                        "double, and no double has its value (refused rather than accept a neighbour)")
        node["const"] = value
    if isinstance(node.get("enum"), list):
        kept, dropped = [], []
        for member in node["enum"]:
            ok, value = _literal_value(member)
            (kept if ok else dropped).append(value)
        if dropped:
            if not kept:
                raise _fail(path, "enum", "every member holds a number that the grammar engine reads as a double, "
                            "and no double has its value")
            warnings.append(f"enum at {path or '/'}: {len(dropped)} member(s) with numbers no double names exactly "
                            f"are not generated ({_short(dropped[0])})")
        node["enum"] = kept
    return node


def fit_bounds(node: dict, path: str, integer: bool) -> dict:
    """``node``'s ``minimum`` / ``maximum`` / ``exclusive*`` and ``multipleOf`` written so
    llguidance reads them exactly, in place (see the module docstring). ``integer``: the node
    allows integers only, so bounds become the exact integer bounds ``minimum`` / ``maximum``.

    Raises:
        GrammarError: (``path`` the keyword's pointer) a lower bound above
            :data:`BOUND_LIMIT` or an upper bound below minus it (nothing the engine can write
            would be valid); a ``multipleOf`` that is not positive or that llguidance would read
            as another value.
    """
    for key in _BOUNDS:
        if key in node and not is_number(node[key]):
            raise _fail(path, key, f"{node[key]!r} is not a number")
    if "multipleOf" in node:
        _fit_multiple(node, path)
    present = [k for k in _BOUNDS if k in node]
    if not present:
        return node
    lows = [(exact(node[k]), k) for k in ("minimum", "exclusiveMinimum") if k in node]
    highs = [(exact(node[k]), k) for k in ("maximum", "exclusiveMaximum") if k in node]
    for value, key in lows:
        exclusive = key.startswith("exclusive")
        if value > BOUND_LIMIT or (value == BOUND_LIMIT and exclusive):
            raise _fail(path, key, f"{value} is at or above {BOUND_LIMIT} (2**63 - 1024), past the largest bound the "
                        "grammar engine supports: no value it can write would be valid")
    for value, key in highs:
        exclusive = key.startswith("exclusive")
        if value < -BOUND_LIMIT or (value == -BOUND_LIMIT and exclusive):
            raise _fail(path, key, f"{value} is at or below -{BOUND_LIMIT} (-(2**63 - 1024)), past the largest bound "
                        "the grammar engine supports: no value it can write would be valid")
    for key in present:
        del node[key]
    if integer:
        lo = max((_int_low(v, k) for v, k in lows), default=None)
        hi = min((_int_high(v, k) for v, k in highs), default=None)
        if lo is not None:
            node["minimum"] = int(_inward_double(max(lo, -BOUND_LIMIT), up=True))
        if hi is not None:
            node["maximum"] = int(_inward_double(min(hi, BOUND_LIMIT), up=False))
        return node
    # A number node: the tightest bound of each side, moved inward onto a double. A bound past
    # the limit on its open side becomes the limit (only values no engine writes are lost).
    for values, up in ((lows, True), (highs, False)):
        if not values:
            continue
        # the tightest: the largest low (exclusive wins a tie), the smallest high
        value, key = max(values, key=lambda p: (p[0], p[1].startswith("exclusive"))) if up else \
            min(values, key=lambda p: (p[0], not p[1].startswith("exclusive")))
        edge = BOUND_LIMIT if up else -BOUND_LIMIT
        if (value < -edge) if up else (value > -edge):
            value, key = -edge, "minimum" if up else "maximum"
        f = _inward_double(value, up)
        moved = Decimal(repr(f)) != value
        if key.startswith("exclusive") and not moved:
            node[key] = f
        else:  # inclusive, or moved strictly inside an exclusive bound
            node["minimum" if up else "maximum"] = f
    return node


def _int_low(value: int | Decimal, key: str) -> int:
    """The smallest integer a lower bound allows."""
    if key == "exclusiveMinimum":
        return math.floor(value) + 1
    return math.ceil(value)


def _int_high(value: int | Decimal, key: str) -> int:
    """The largest integer an upper bound allows."""
    if key == "exclusiveMaximum":
        return math.ceil(value) - 1
    return math.floor(value)


def _fit_multiple(node: dict, path: str) -> None:
    m = node["multipleOf"]
    if not is_number(m) or exact(m) <= 0:
        raise _fail(path, "multipleOf", f"{m!r} must be a number greater than 0 (JSON Schema 2020-12, 6.2.1)")
    value = exact(m)
    f = float_literal(value)
    read = _llguidance_multiple(f) if f is not None else None
    if read is None or read != value:
        raise _fail(path, "multipleOf", f"{value} is read by the grammar engine as a double turned into a decimal "
                    f"({read if read is not None else 'refused'}), not as {value}")
    node["multipleOf"] = int(f) if isinstance(value, int) else f


def check_multiples(multiples: list[tuple[str, int | Decimal]]) -> None:
    """Refuse ``multipleOf`` values (``(pointer, value)`` pairs of one schema) that llguidance
    could combine wrongly. llguidance 1.9 intersects two ``multipleOf`` (``allOf`` members,
    ``$ref`` siblings, ``anyOf`` spread) with an lcm over u32 coefficients scaled to the larger
    exponent, as ``a * b / gcd(a, b)``, which wraps past 2**32: ``multipleOf`` 65536 and 65537
    together became 65536 and accepted 65536. Whatever order it combines them in, no step
    overflows while the product of all the distinct values' coefficients, scaled to the largest
    exponent, stays below 2**32; past that the schema is refused.

    Raises:
        GrammarError: (``path`` the second value's pointer) the product overflows.
    """
    distinct: dict[Decimal, str] = {}
    for path, value in multiples:
        distinct.setdefault(Decimal(value).normalize(), path)
    if len(distinct) < 2:
        return
    exps = {d: max(0, -d.as_tuple().exponent) for d in distinct}
    top = max(exps.values())
    product = 1
    for d in distinct:
        product *= int(d.scaleb(top))
    if product > 2**32 - 1:
        values = ", ".join(str(d) for d in distinct)
        path = list(distinct.values())[1]
        raise GrammarError(
            f"json_schema multipleOf at {path}: the values {values} combine past what the grammar engine computes "
            "exactly (it intersects them with a 32-bit lcm that wraps)", field="json_schema", path=path)


def plain_json(value: Any) -> Any:
    """``value`` with every ``Decimal`` left in it (annotations, unknown keywords) as a float:
    what leaves the normalizer is plain JSON for any consumer."""
    if isinstance(value, Decimal):
        return int(value) if is_integral(value) and abs(value) < 2**63 else float(value)
    if isinstance(value, dict):
        return {k: plain_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain_json(v) for v in value]
    return value


def _short(v: Any) -> str:
    text = json.dumps(plain_json(v)) if not isinstance(v, Decimal) else str(v)
    return text if len(text) <= 60 else text[:57] + "..."
