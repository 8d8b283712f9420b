"""``s.fork(n)``'s branches as one object: ``forks += x`` to every branch, ``forks[i]`` one
branch, :meth:`ProgramStateGroup.join` merging them back into the parent
(:mod:`sgrt.lang.interpreter` has ``ProgramState``; SGLang's frontend ``ProgramStateGroup``).
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

from sgrt.errors import InvalidRequest
from sgrt.lang import ir
from sgrt.lang.executor import StreamExecutor


class ProgramState(Protocol):
    """What the group needs of a branch (:class:`sgrt.lang.interpreter.ProgramState`)."""

    executor: StreamExecutor

    def __iadd__(self, other: Any) -> Any: ...


class ProgramStateGroup:
    """The branches of ``s.fork(n)``.

    ``forks += x`` appends to every branch: a str or primitive or expression to all, a list
    with one entry per branch, or a callable ``f(i)`` giving branch ``i``'s entry.
    ``forks[i]["var"]`` reads a branch's variable. :meth:`join` ends the fork.
    """

    def __init__(self, states: list[ProgramState], parent: ProgramState):
        self.states = states
        self.parent = parent
        self._parent_vars = set(parent.executor.variables)
        self._joined = False

    def __len__(self) -> int:
        return len(self.states)

    def __getitem__(self, i: int) -> ProgramState:
        return self.states[i]

    def __setitem__(self, i: int, value: Any) -> None:
        """What ``forks[i] += x`` ends with: Python stores the (same) branch back.

        Raises:
            TypeError: ``value`` is not branch ``i`` itself (branches cannot be replaced).
        """
        if value is not self.states[i]:
            raise TypeError("a fork group's branches cannot be replaced; use forks[i] += ...")

    def __iter__(self) -> Iterator[ProgramState]:
        return iter(self.states)

    def __iadd__(self, other: Any) -> "ProgramStateGroup":
        for state, entry in zip(self.states, ir.fork_entries(other, len(self.states))):
            state += entry
        return self

    def join(self, mode: str = "gather_variable") -> None:
        """Wait for every branch and merge them into the parent.

        ``"gather_variable"`` (default): each variable the branches created becomes, on the
        parent, the list of its per-branch values (``s["x"][i]``; ``s.get_meta_info("x")[i]``
        the branch's meta info, where SGLang keeps none), also for a single branch
        (``s.copy()``). ``"concate_and_append"``: additionally the branches' texts are appended
        to the parent's text, in order.

        Raises:
            InvalidRequest: (field ``mode``) another mode.
            Exception: the first branch's error, if a branch failed.
        """
        if mode not in ("gather_variable", "concate_and_append"):
            raise InvalidRequest(
                f"join mode must be 'gather_variable' or 'concate_and_append', got {mode!r}",
                field="mode")
        if self._joined:
            return
        self._joined = True
        for state in self.states:
            state.executor.sync()
        for state in self.states:
            state.executor.raise_if_failed()
        names: list[str] = []
        for state in self.states:
            for name in state.executor.variables:
                if name not in self._parent_vars and name not in names:
                    names.append(name)
        parent = self.parent.executor
        for name in names:
            parent.set_var(name, [s.executor.variables.get(name) for s in self.states],
                           [s.executor.meta_info.get(name) for s in self.states])
        if mode == "concate_and_append":
            parent.submit(ir.AppendForks(list(self.states)))
