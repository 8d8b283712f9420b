"""Tracing: run a program without a model and record what it would do, as a graph.

``fn.trace()`` calls the program with a :class:`TracerProgramState`: arguments not given become
:class:`Placeholder` s, ``s["x"]`` returns a placeholder for the generated value, and every
``s += ...`` becomes a :class:`TraceNode`. Placeholders may be concatenated and used in
f-strings (unlike SGLang, where f-strings break tracing); Python control flow that depends on a
placeholder's value (``if s["x"] == ...``, ``len(arg)``) stops the trace there, and the graph
records where.

SGLang's graph API is there too: ``fn.trace().last_node`` is the program's last node and
``last_node.print_graph_dfs()`` returns, as text, the lines of every node it depends on (a
variable read from a fork branch pulls in that branch's nodes).

The graph's *constant prefix* (the text before the first argument, variable or generation,
chat template applied) is what ``run_batch`` and ``fn.cache()`` put into the prefix cache
before running (prefix hinting).
"""
from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, field
from typing import Any

from sgrt.chat_template import ChatTemplate
from sgrt.lang import ir
from sgrt.lang.transcript import Transcript

_MARK_OPEN, _MARK_CLOSE = "\ue000", "\ue001"
_MARK_RE = re.compile(f"{_MARK_OPEN}(\\d+){_MARK_CLOSE}")


class StopTracing(AttributeError):
    """Raised when a program's control flow depends on a value tracing does not know.

    Subclasses ``AttributeError`` so that ``hasattr`` on a placeholder stays False.
    """


class Placeholder(ir.Expr):
    """Stands for a program argument or a generated variable while tracing.

    Concatenation and formatting work (they record a reference); inspecting the value raises
    :class:`StopTracing`. ``source`` is the node that produces a variable, as the state it was
    read from (``s["x"]``, ``forks[i]["x"]``) knew it then (SGLang's ``SglVariable.source``).
    """

    __slots__ = ("kind", "name", "index", "source", "_tracer")

    def __init__(self, tracer: "Tracer", kind: str, name: str,
                 source: "TraceNode | None" = None):
        object.__setattr__(self, "kind", kind)
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "source", source)
        object.__setattr__(self, "_tracer", tracer)
        object.__setattr__(self, "index", tracer.register(self))

    def __str__(self) -> str:
        return f"{_MARK_OPEN}{self.index}{_MARK_CLOSE}"

    def __format__(self, spec: str) -> str:
        return str(self)

    def __repr__(self) -> str:
        return f"{'Arg' if self.kind == 'arg' else 'Var'}({self.name!r})"

    def _stop(self, *_: Any, **__: Any):
        raise StopTracing(f"the program inspects the value of {self!r}")

    __bool__ = __len__ = __iter__ = __contains__ = __int__ = __float__ = __index__ = _stop
    __eq__ = __ne__ = __lt__ = __le__ = __gt__ = __ge__ = __getitem__ = __call__ = _stop
    __hash__ = object.__hash__

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        self._stop()


@dataclass(eq=False)
class TraceNode:
    """One recorded step: ``expr`` appended to stream ``stream`` after node ``prev``.

    Kinds: ``text``, ``role_begin``, ``role_end``, ``gen``, ``select``, ``arg``, ``var`` (a
    generated value appended), ``var_scope_begin``, ``var_scope_end``, ``fork``, ``join``,
    ``stop`` (tracing stopped: data-dependent control flow).
    """

    node_id: int
    kind: str
    stream: int
    prev: "TraceNode | None"
    expr: Any = None
    sources: list["TraceNode"] = field(default_factory=list)  # data / fork-join edges
    label: str = ""

    def describe(self) -> str:
        return self.label or repr(self.expr)

    @property
    def prev_node(self) -> "TraceNode | None":
        """SGLang's name for :attr:`prev` (the node this one was appended after)."""
        return self.prev

    def line(self) -> str:
        """This node as one SSA-like line: ``%3 = %2 + Gen('answer')``, then ``  <- %1`` for
        its data and join sources."""
        prev = f"%{self.prev.node_id} + " if self.prev is not None else ""
        src = "  <- " + ", ".join(f"%{s.node_id}" for s in self.sources) if self.sources else ""
        return f"%{self.node_id} = {prev}{self.describe()}{src}"

    def print_graph_dfs(self) -> str:
        """The lines (:meth:`line`) of this node and of every node it depends on, each after
        its dependencies (the node before it, then its sources), one per line; SGLang's
        ``SglExpr.print_graph_dfs``, which also returns the text rather than printing it."""
        lines: list[str] = []
        done: set[int] = set()
        stack: list[tuple[TraceNode, bool]] = [(self, False)]
        while stack:  # NOTE: iterative: a long program's chain is deeper than Python's stack
            node, expanded = stack.pop()
            if node.node_id in done:
                continue
            if expanded:
                done.add(node.node_id)
                lines.append(node.line())
                continue
            stack.append((node, True))
            deps = ([node.prev] if node.prev is not None else []) + list(node.sources)
            for dep in reversed(deps):
                if dep.node_id not in done:
                    stack.append((dep, False))
        return "\n".join(lines) + "\n"


class Tracer:
    """Shared state of one trace: node ids, placeholders, streams."""

    def __init__(self, template: ChatTemplate):
        self.template = template
        self.nodes: list[TraceNode] = []
        self.placeholders: list[Placeholder] = []
        self._stream_ids = itertools.count()
        self.stopped: str | None = None

    def register(self, p: Placeholder) -> int:
        self.placeholders.append(p)
        return len(self.placeholders) - 1

    def new_stream(self) -> int:
        return next(self._stream_ids)

    def add(self, kind: str, stream: int, prev: TraceNode | None, expr: Any = None,
            sources: list[TraceNode] | None = None, label: str = "") -> TraceNode:
        node = TraceNode(len(self.nodes), kind, stream, prev, expr, list(sources or []), label)
        self.nodes.append(node)
        return node


class TracerProgramState:
    """The ``s`` a program gets while traced: records instead of generating."""

    def __init__(self, tracer: Tracer, transcript: Transcript | None = None,
                 stream: int | None = None, prev: TraceNode | None = None,
                 constant: bool = True, variables: dict[str, TraceNode] | None = None):
        self.tracer = tracer
        self.transcript = transcript or Transcript(tracer.template)
        self.stream = tracer.new_stream() if stream is None else stream
        self.last = prev
        # The node that produces each variable this state can read (a fork branch starts with
        # its parent's, as SGLang's tracer copies them).
        self.variables: dict[str, TraceNode] = dict(variables or {})
        # Whether everything so far is constant text (the prefix is still growing).
        self.constant = constant
        self.prefix = self.transcript.text if constant else ""

    # ---- recording ------------------------------------------------------------------------

    def _record(self, kind: str, expr: Any = None, sources=None, label: str = "") -> TraceNode:
        self.last = self.tracer.add(kind, self.stream, self.last, expr, sources, label)
        return self.last

    def __iadd__(self, other: Any) -> "TracerProgramState":
        for leaf in ir.to_expr(other).flatten():
            self._append(leaf)
        return self

    def _append(self, leaf: ir.Expr) -> None:
        if isinstance(leaf, ir.ConstantText):
            self._append_text(leaf.value)
        elif isinstance(leaf, Placeholder):
            self._append_placeholder(leaf)
        elif isinstance(leaf, ir.RoleBegin):
            self.transcript.begin_role(leaf.role)
            self._record("role_begin", leaf)
            self._grow_prefix()
        elif isinstance(leaf, ir.RoleEnd):
            self.transcript.end_role(leaf.role)
            self._record("role_end", leaf)
            self._grow_prefix()
        elif isinstance(leaf, (ir.Gen, ir.Select)):
            self.constant = False
            node = self._record("gen" if isinstance(leaf, ir.Gen) else "select", leaf)
            if leaf.name is not None:
                self.variables[leaf.name] = node
                self.transcript.fill(str(Placeholder(self.tracer, "var", leaf.name, node)))
        elif isinstance(leaf, ir.VarScopeBegin):
            self._record("var_scope_begin", leaf)
        elif isinstance(leaf, ir.VarScopeEnd):
            node = self._record("var_scope_end", leaf)
            self.variables[leaf.name] = node
        else:  # image / video / separate_reasoning: the text after them is not constant
            self.constant = False
            self._record("other", leaf)

    def _append_text(self, text: str) -> None:
        pos = 0
        for m in _MARK_RE.finditer(text):
            if m.start() > pos:
                self._append_plain(text[pos:m.start()])
            self._append_placeholder(self.tracer.placeholders[int(m.group(1))])
            pos = m.end()
        if pos < len(text):
            self._append_plain(text[pos:])

    def _append_plain(self, text: str) -> None:
        self.transcript.fill(text)
        self._record("text", ir.ConstantText(text))
        self._grow_prefix()

    def _append_placeholder(self, p: Placeholder) -> None:
        self.constant = False
        source = p.source if p.kind == "var" else None
        self._record(p.kind, p, sources=[source] if source else None)
        self.transcript.fill(str(p))

    def _grow_prefix(self) -> None:
        if self.constant:
            self.prefix = self.transcript.text

    # ---- the ProgramState surface ---------------------------------------------------------

    def __getitem__(self, name: str) -> Placeholder:
        return Placeholder(self.tracer, "var", name, self.variables.get(name))

    get_var = __getitem__

    def __setitem__(self, name: str, value: Any) -> None:
        pass

    def __contains__(self, name: str) -> bool:
        return True

    def _role(self, role: str, expr: Any = None):
        if expr is None:
            return _RoleScope(self, role)
        self += ir.RoleBegin(role) + ir.to_expr(expr) + ir.RoleEnd(role)
        return None

    def system(self, expr: Any = None):
        return self._role("system", expr)

    def user(self, expr: Any = None):
        return self._role("user", expr)

    def assistant(self, expr: Any = None):
        return self._role("assistant", expr)

    def var_scope(self, name: str):
        return _Scope(self, ir.VarScopeBegin(name), ir.VarScopeEnd(name))

    def fork(self, size: int = 1, position_ids_offset: Any = None) -> "TracerStateGroup":
        node = self._record("fork", None, label=f"fork({size})")
        self.constant = False
        branches = [TracerProgramState(self.tracer, self.transcript.copy(), prev=node,
                                       constant=False, variables=self.variables)
                    for _ in range(size)]
        return TracerStateGroup(branches, self, node)

    def copy(self):
        return _CopyScope(self)

    def text(self) -> str:
        return self.transcript.text

    def sync(self) -> None:
        pass

    def get_meta_info(self, name: str) -> None:
        return None

    def messages(self) -> list[dict[str, str]]:
        return list(self.transcript.messages)

    def error(self) -> None:
        return None


class _RoleScope:
    def __init__(self, state: TracerProgramState, role: str):
        self.state, self.role = state, role

    def __enter__(self):
        self.state += ir.RoleBegin(self.role)

    def __exit__(self, exc_type, *_):
        if exc_type is None:
            self.state += ir.RoleEnd(self.role)


class _Scope:
    def __init__(self, state: TracerProgramState, begin: ir.Expr, end: ir.Expr):
        self.state, self.begin, self.end = state, begin, end

    def __enter__(self):
        self.state += self.begin

    def __exit__(self, exc_type, *_):
        if exc_type is None:
            self.state += self.end


class _CopyScope:
    def __init__(self, state: TracerProgramState):
        self.state = state

    def __enter__(self) -> TracerProgramState:
        self.group = self.state.fork(1)
        return self.group[0]

    def __exit__(self, exc_type, *_):
        if exc_type is None:
            self.group.join()


class TracerStateGroup:
    """Fork branches while tracing (mirrors ``ProgramStateGroup``)."""

    def __init__(self, states: list[TracerProgramState], parent: TracerProgramState,
                 node: TraceNode):
        self.states, self.parent, self.node = states, parent, node

    def __len__(self) -> int:
        return len(self.states)

    def __getitem__(self, i: int) -> TracerProgramState:
        return self.states[i]

    def __setitem__(self, i: int, value: Any) -> None:
        if value is not self.states[i]:
            raise TypeError("a fork group's branches cannot be replaced; use forks[i] += ...")

    def __iter__(self):
        return iter(self.states)

    def __iadd__(self, other: Any) -> "TracerStateGroup":
        for state, entry in zip(self.states, ir.fork_entries(other, len(self.states))):
            state += entry
        return self

    def join(self, mode: str = "gather_variable") -> None:
        ends = [s.last for s in self.states if s.last is not None]
        node = self.parent._record("join", None, sources=ends, label=f"join({mode!r})")
        for s in self.states:  # variables the branches created are the join's (gathered) values
            for name in s.variables:
                self.parent.variables.setdefault(name, node)
        if mode == "concate_and_append":
            for s in self.states:
                self.parent.transcript.fill(s.transcript.text[len(self.parent.transcript.text):])


@dataclass
class TracedProgram:
    """The recorded graph of a program.

    ``nodes`` in recording order; ``prefix`` the constant text a run of the program starts
    with (chat template applied); ``complete`` is False when tracing stopped early
    (``stop_reason`` says why: the program's control flow depended on a generated value).
    ``last_node`` is the program's own last node (SGLang's ``tracer.last_node``):
    ``last_node.print_graph_dfs()`` is the text of everything the program's end depends on.
    """

    nodes: list[TraceNode]
    prefix: str
    complete: bool = True
    stop_reason: str | None = None
    last_node: TraceNode | None = None

    def edges(self) -> list[tuple[int, int, str]]:
        """``(src, dst, kind)`` edges: ``seq`` (program order), ``data`` and ``join``."""
        out = []
        for n in self.nodes:
            if n.prev is not None:
                out.append((n.prev.node_id, n.node_id, "seq"))
            for s in n.sources:
                out.append((s.node_id, n.node_id, "join" if n.kind == "join" else "data"))
        return out

    def format_graph(self) -> str:
        """The graph as SSA-like lines: ``%3 = %2 + Gen('answer')``; branches indented."""
        lines = []
        for n in self.nodes:
            indent = "  " * (1 if n.stream else 0)
            stream = f"[{n.stream}] " if n.stream else ""
            lines.append(f"{indent}{stream}{n.line()}")
        if not self.complete:
            lines.append(f"# tracing stopped: {self.stop_reason}")
        return "\n".join(lines)

    def print_graph(self) -> None:
        """Print :meth:`format_graph`."""
        print(self.format_graph())

    def to_dot(self) -> str:
        """The graph in Graphviz dot syntax."""
        lines = ["digraph program {"]
        for n in self.nodes:
            label = n.describe().replace('"', '\\"')
            lines.append(f'  n{n.node_id} [label="%{n.node_id} {label}"];')
        for a, b, kind in self.edges():
            style = "" if kind == "seq" else ' [style=dashed]'
            lines.append(f"  n{a} -> n{b}{style};")
        lines.append("}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.format_graph()


def trace_program(func: Any, template: ChatTemplate, arg_names: list[str],
                  known: dict[str, Any]) -> TracedProgram:
    """Trace ``func(s, **args)``; arguments not in ``known`` become placeholders."""
    tracer = Tracer(template)
    state = TracerProgramState(tracer)
    kwargs = {name: known[name] if name in known else Placeholder(tracer, "arg", name)
              for name in arg_names}
    complete, reason = True, None
    try:
        func(state, **kwargs)
    except (StopTracing, TypeError, ValueError) as e:  # data-dependent control flow
        complete, reason = False, f"{type(e).__name__}: {e}"
        state._record("stop", None, label=f"stop({type(e).__name__})")
    return TracedProgram(tracer.nodes, state.prefix, complete, reason, state.last)
