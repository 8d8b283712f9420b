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

# SGLang's dtype regexes (``sglang.lang.ir``), the same strings, for programs that pass them as
# ``gen(regex=REGEX_INT)``. ``gen(dtype=...)`` does not use them: its regexes are bounded
# (``sgrt.constrained.dtypes``), while REGEX_STR here allows a string of any length.
REGEX_INT = r"[-+]?[0-9]+[ \n]*"
REGEX_FLOAT = r"[-+]?[0-9]*\.?[0-9]+[ \n]*"
REGEX_BOOL = r"(True|False)"
REGEX_STR = r"\"[\w\d\s]*\""

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
    first goes into the text, all n into the variable as a list. ``params`` may hold two keys
    that are not engine fields: ``stop_regex`` (the backends apply it) and
    ``return_text_in_logprobs`` (the interpreter applies it).
    """

    name: str | None
    params: dict[str, Any] = field(default_factory=dict)
    dtype: Any = None
    n: int | None = None  # None: inherit run()'s n (default 1)

    def __repr__(self) -> str:
        extra = "".join(f", {k}={v!r}" for k, v in self.params.items())
        if self.dtype is not None:
            extra += f", dtype={getattr(self.dtype, '__name__', self.dtype)}"
        if self.n not in (None, 1):
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


@dataclass(eq=False)
class Image(Expr):
    """An image input (``sgrt.image(path)``); executing it needs a model with a vision tower."""

    path: Any

    def __repr__(self) -> str:
        return f"Image({self.path!r})"


@dataclass(eq=False)
class Video(Expr):
    """A video input (``sgrt.video(path, num_frames)``); needs a model with a vision tower."""

    path: Any
    num_frames: int = 0

    def __repr__(self) -> str:
        return f"Video({self.path!r}, {self.num_frames})"


@dataclass(eq=False)
class SeparateReasoning(Expr):
    """Split the thinking part off the variables ``expr``'s gens / selects produced.

    Follows SGLang's ``SglSeparateReasoning``: each named gen or select ``x`` inside ``expr``
    keeps only the answer, ``x_reasoning_content`` gets the reasoning, and the text of the open
    message is replaced by the answer (see ``sgrt.lang.reasoning``).
    """

    model_type: str | None
    expr: Expr

    @property
    def targets(self) -> list[str]:
        """The names of the variables it splits."""
        return [leaf.name for leaf in self.expr.flatten()
                if isinstance(leaf, (Gen, Select)) and leaf.name is not None]

    def __repr__(self) -> str:
        return f"SeparateReasoning({self.model_type!r}, {self.targets!r})"


def reasoning_var_name(name: str) -> str:
    """The variable that holds the reasoning split off variable ``name`` (SGLang's naming)."""
    return f"{name}_reasoning_content"


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


def fork_entries(other: Any, n: int) -> list[Any]:
    """What each of ``n`` fork branches gets from ``forks += other`` (SGLang's
    ``ProgramStateGroup.__iadd__``): a list or tuple gives branch ``i`` its entry ``i``, a callable
    that is not an expression gives ``other(i)``, anything else goes to every branch.

    Raises:
        InvalidRequest: (field ``forks``) a list whose length is not ``n``.
    """
    if isinstance(other, (list, tuple)):
        if len(other) != n:
            raise InvalidRequest(f"forks += list needs one entry per branch ({n}), got {len(other)}",
                                 field="forks")
        return list(other)
    if callable(other) and not isinstance(other, Expr):
        return [other(i) for i in range(n)]
    return [other] * n


def var_names(expr: Expr) -> list[str]:
    """Names of the variables ``expr`` will set (gens, selects, var scopes)."""
    names = []
    for leaf in expr.flatten():
        if isinstance(leaf, (Gen, Select)) and leaf.name is not None:
            names.append(leaf.name)
        elif isinstance(leaf, VarScopeBegin):
            names.append(leaf.name)
        elif isinstance(leaf, SeparateReasoning):
            names.extend(reasoning_var_name(n) for n in leaf.targets)
    return names


def _check_role(role: str) -> None:
    if role not in ROLES:
        raise InvalidRequest(f"role must be one of {ROLES}, got {role!r}", field="role")
