"""The DSL's expressions: what ``s += ...`` takes and what ``trace()`` records.

``gen``, ``select``, the role markers and constant text are :class:`Expr` nodes; ``"Q: " +
gen("a")`` concatenates into an :class:`ExprList`. The interpreter executes them; the tracer
records them as graph nodes.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sgrt.errors import InvalidRequest

ROLES = ("system", "user", "assistant")

class Expr:
    """Base of every DSL expression; ``a + b`` (either side may be a str) builds an ExprList."""

    def __add__(self, other: Any) -> "ExprList":
        return ExprList([self, to_expr(other)])

    def __radd__(self, other: Any) -> "ExprList":
        return ExprList([to_expr(other), self])

    def flatten(self) -> list["Expr"]:
        """The leaf expressions in order."""
        return [self]


@dataclass(eq=False)
class ExprList(Expr):
    """A sequence of expressions executed in order."""

    items: list[Expr] = field(default_factory=list)

    def __post_init__(self) -> None:
        flat: list[Expr] = []
        for item in self.items:
            flat.extend(to_expr(item).flatten())
        self.items = flat

    def flatten(self) -> list[Expr]:
        return list(self.items)

    def __repr__(self) -> str:
        return " + ".join(repr(x) for x in self.items)


@dataclass(eq=False)
class ConstantText(Expr):
    """Literal text appended to the transcript."""

    value: str

    def __repr__(self) -> str:
        text = self.value if len(self.value) <= 40 else self.value[:37] + "..."
        return f"Constant({text!r})"


@dataclass(eq=False)
class RoleBegin(Expr):
    """Start of a chat message: appends the role's template prefix."""

    role: str

    def __post_init__(self) -> None:
        _check_role(self.role)

    def __repr__(self) -> str:
        return f"RoleBegin({self.role!r})"


@dataclass(eq=False)
class RoleEnd(Expr):
    """End of a chat message: appends the role's template suffix and records the message."""

    role: str

    def __post_init__(self) -> None:
        _check_role(self.role)

    def __repr__(self) -> str:
        return f"RoleEnd({self.role!r})"


@dataclass(eq=False)
class Gen(Expr):
    """Generate text into variable ``name``.

    ``params`` holds only the sampling options the call set explicitly (SamplingParams field
    names); the rest are inherited from ``run()`` and then ``sgrt.lang.defaults``. ``dtype`` is
    turned into a bounded regex when the call executes. ``n > 1`` samples n completions: the
    first goes into the text, all n into the variable as a list.
    """

    name: str | None
    params: dict[str, Any] = field(default_factory=dict)
    dtype: Any = None
    n: int = 1

    def __repr__(self) -> str:
        extra = "".join(f", {k}={v!r}" for k, v in self.params.items())
        if self.dtype is not None:
            extra += f", dtype={getattr(self.dtype, '__name__', self.dtype)}"
        if self.n != 1:
            extra += f", n={self.n}"
        return f"Gen({self.name!r}{extra})"


@dataclass(eq=False)
class Select(Expr):
    """Choose one of ``choices`` by their log-probabilities; the decision goes into ``name``."""

    name: str | None
    choices: list[str]
    choices_method: Any = None

    def __repr__(self) -> str:
        return f"Select({self.name!r}, {self.choices!r})"


@dataclass(eq=False)
class VarScopeBegin(Expr):
    """Start capturing the text appended from here into variable ``name``."""

    name: str

    def __repr__(self) -> str:
        return f"VarScopeBegin({self.name!r})"


@dataclass(eq=False)
class VarScopeEnd(Expr):
    """Stop capturing into variable ``name``; the variable becomes readable."""

    name: str

    def __repr__(self) -> str:
        return f"VarScopeEnd({self.name!r})"


@dataclass(eq=False)
class CommitPrefix(Expr):
    """Put the text so far into the backend's prefix cache (a prefill-only request)."""

    num_branches: int = 1

    def __repr__(self) -> str:
        return f"CommitPrefix({self.num_branches})"


@dataclass(eq=False)
class AppendForks(Expr):
    """Append the text each fork branch produced (``join(mode="concate_and_append")``)."""

    states: list[Any] = field(default_factory=list)

    def __repr__(self) -> str:
        return f"AppendForks({len(self.states)})"


def to_expr(value: Any) -> Expr:
    """Turn what ``s += value`` accepts into an :class:`Expr`.

    Strings become :class:`ConstantText`; ``int``, ``float`` and ``bool`` their ``str``.

    Raises:
        TypeError: ``value`` is ``None`` or of another type.
    """
    if isinstance(value, Expr):
        return value
    if isinstance(value, str):
        return ConstantText(value)
    if isinstance(value, (bool, int, float)):
        return ConstantText(str(value))
    if value is None:
        raise TypeError("cannot append None to a program state")
    raise TypeError(
        f"cannot append a {type(value).__name__} to a program state "
        "(use str, int, float, bool or a DSL expression such as gen(...))"
    )


def var_names(expr: Expr) -> list[str]:
    """Names of the variables ``expr`` will set (gens, selects, var scopes)."""
    names = []
    for leaf in expr.flatten():
        if isinstance(leaf, (Gen, Select)) and leaf.name is not None:
            names.append(leaf.name)
        elif isinstance(leaf, VarScopeBegin):
            names.append(leaf.name)
    return names


def _check_role(role: str) -> None:
    if role not in ROLES:
        raise InvalidRequest(f"role must be one of {ROLES}, got {role!r}", field="role")
