"""Runs programs: ``ProgramState`` (what ``s`` is) over a ``StreamExecutor`` per state
(:mod:`sgrt.lang.executor`, re-exported here).

``s += expr`` queues the expression and returns at once: the program's Python code runs ahead
of generation and blocks only when it reads a variable (``s["x"]``) or the text. Each state
(and each fork branch) has its own executor whose worker thread runs the queued expressions in
order against the backend, so sibling branches' requests reach the engine together and are
batched there. A worker thread lives only while its queue has work.

Errors: an exception while executing (a failed request, a constraint the engine refuses, a role
misuse) is stored; the rest of the queue is skipped; every blocked reader wakes up and
``s.text()``, ``s["x"]`` (for a value not produced before the failure), ``s.messages()`` raise
that same exception. ``s.error()`` returns it. Nothing waits forever on a failed program.
"""
from __future__ import annotations

import asyncio
import copy
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from sgrt.lang import ir
from sgrt.lang.executor import StreamExecutor  # noqa: F401 - re-exported
from sgrt.lang.fork_group import ProgramStateGroup


@dataclass
class _Cursor:
    """Where a streaming reader is: in the whole text, or in one variable's chunks."""

    var: str | None
    pos: int = 0
    idx: int = 0
    completion_tokens: int = 0
    held_ids: list[int] = field(default_factory=list)
    held_logprobs: list[Any] = field(default_factory=list)
    held_top: list[Any] = field(default_factory=list)
    done: bool = False


class ProgramState:
    """The ``s`` of a program: append expressions, read variables and text.

    Create it with ``fn.run(...)``; a program receives it as its first argument.
    """

    def __init__(self, executor: StreamExecutor):
        self.executor = executor

    # ---- building -------------------------------------------------------------------------

    def __iadd__(self, other: Any) -> "ProgramState":
        self.executor.submit(other)
        return self

    def _role(self, role: str, expr: Any = None):
        if expr is None:
            return self._role_scope(role)
        self.executor.submit(ir.RoleBegin(role) + ir.to_expr(expr) + ir.RoleEnd(role))
        return None

    @contextmanager
    def _role_scope(self, role: str) -> Iterator[None]:
        self.executor.submit(ir.RoleBegin(role))
        yield
        self.executor.submit(ir.RoleEnd(role))

    def system(self, expr: Any = None):
        """Append a system message holding ``expr``; without ``expr``, a ``with`` block."""
        return self._role("system", expr)

    def user(self, expr: Any = None):
        """Append a user message holding ``expr``; without ``expr``, a ``with`` block."""
        return self._role("user", expr)

    def assistant(self, expr: Any = None):
        """Append an assistant message holding ``expr``; without ``expr``, a ``with`` block."""
        return self._role("assistant", expr)

    @contextmanager
    def var_scope(self, name: str) -> Iterator[None]:
        """Capture the text appended inside the ``with`` block into variable ``name``."""
        self.executor.submit(ir.VarScopeBegin(name))
        yield
        self.executor.submit(ir.VarScopeEnd(name))

    def fork(self, size: int = 1, position_ids_offset: Any = None) -> "ProgramStateGroup":
        """``size`` branches that continue from the text so far (see ``ProgramStateGroup``;
        ``position_ids_offset`` as ``StreamExecutor.fork`` says)."""
        return ProgramStateGroup(
            [ProgramState(e) for e in self.executor.fork(size, position_ids_offset)], self)

    @contextmanager
    def copy(self, position_ids_offset: Any = None) -> Iterator["ProgramState"]:
        """``with s.copy() as c:`` a branch for trying things; ``s``'s text is not changed.

        SGLang's ``copy``: a fork of one branch, joined on exit (``gather_variable``), so each
        variable the branch created is on ``s`` as a one-item list (``s["x"][0]``). The join
        also happens when the block raises; that exception is the one that propagates.
        """
        group = self.fork(1, position_ids_offset)
        try:
            yield group[0]
        except BaseException:
            try:
                group.join()
            except Exception:  # noqa: BLE001 - the block's own error is the one to report
                pass
            raise
        group.join()

    # ---- reading --------------------------------------------------------------------------

    def __getitem__(self, name: str) -> Any:
        return self.executor.get_var(name)

    def get_var(self, name: str) -> Any:
        """``s[name]``: the variable's value, waiting for it (see ``StreamExecutor.get_var``)."""
        return self.executor.get_var(name)

    def __setitem__(self, name: str, value: Any) -> None:
        self.executor.set_var(name, value)

    def set_var(self, name: str, value: Any) -> None:
        self.executor.set_var(name, value)

    def __contains__(self, name: str) -> bool:
        with self.executor.cond:
            return name in self.executor.variables or name in self.executor.pending

    def get_meta_info(self, name: str) -> Any:
        """Meta info of the gen or select that produced ``name`` (token counts, logprobs...)."""
        return self.executor.get_meta_info(name)

    def text(self) -> str:
        """The whole text, after everything queued has run.

        Raises:
            Exception: the error that stopped the program, if any.
        """
        self.executor.sync()
        self.executor.raise_if_failed()
        return self.executor.transcript.text

    def messages(self) -> list[dict[str, str]]:
        """The OpenAI-style messages of the role blocks so far (after a sync)."""
        self.executor.sync()
        self.executor.raise_if_failed()
        return copy.deepcopy(self.executor.transcript.messages)

    def sync(self) -> None:
        """Wait until everything queued has run."""
        self.executor.sync()

    def error(self) -> BaseException | None:
        """The exception that stopped the program, or ``None`` (waits for the program first)."""
        self.executor.sync()
        return self.executor.error_

    def abort(self) -> None:
        """Abort the running request(s); readers then raise ``RequestAborted``."""
        self.executor.abort()

    @property
    def ret_value(self) -> Any:
        """What the program function returned."""
        self.executor.sync()
        return self.executor.ret_value

    # ---- streaming ------------------------------------------------------------------------

    def text_iter(self, var_name: str | None = None) -> Iterator[str]:
        """Yield the text (or one variable's text) as it is generated.

        Without ``stream=True`` yields the final value once.

        Raises:
            KeyError: ``var_name`` is never generated.
            Exception: the error that stopped the program.
        """
        for piece, _ in self._iter(var_name):
            yield piece

    async def text_async_iter(self, var_name: str | None = None,
                              return_meta_data: bool = False) -> AsyncIterator[Any]:
        """Async :meth:`text_iter`; with ``return_meta_data`` yields ``(text, meta)``.

        Each ``meta`` of a variable's stream holds ``output_token_ids`` and (if the gen asked for
        them) ``output_token_logprobs`` / ``output_top_logprobs`` for exactly the tokens of that
        piece, and the running ``completion_tokens``; the last also holds the gen's final meta.
        """
        loop = asyncio.get_running_loop()
        cursor = _Cursor(var_name)
        if not self.executor.stream:
            value = await loop.run_in_executor(None, self._final_value, var_name)
            meta = await loop.run_in_executor(None, self._final_meta, var_name)
            yield (value, meta) if return_meta_data else value
            return
        while True:
            item = await loop.run_in_executor(None, self._next_piece, cursor, 0.5)
            if item is None:
                return
            if item[0] is None:  # timed out with nothing new: check again
                continue
            yield item if return_meta_data else item[0]

    def _final_value(self, var_name: str | None) -> str:
        return self.text() if var_name is None else self.get_var(var_name)

    def _final_meta(self, var_name: str | None) -> Any:
        return None if var_name is None else self.get_meta_info(var_name)

    def _iter(self, var_name: str | None) -> Iterator[tuple[str, Any]]:
        if not self.executor.stream:
            yield self._final_value(var_name), self._final_meta(var_name)
            return
        cursor = _Cursor(var_name)
        while True:
            item = self._next_piece(cursor, None)
            if item is None:
                return
            yield item

    def _next_piece(self, cur: _Cursor, timeout: float | None) -> tuple[Any, Any] | None:
        """Block until the cursor's stream has new text; ``None`` when it has ended.

        Returns ``(None, None)`` if ``timeout`` passed with nothing new.
        """
        ex = self.executor
        with ex.cond:
            while True:
                if cur.done:
                    return None
                if cur.var is None:
                    text = ex.transcript.text
                    if len(text) > cur.pos:
                        piece = text[cur.pos:]
                        cur.pos = len(text)
                        return piece, None
                    if ex.error_ is not None:
                        raise ex.error_
                    if not ex._outstanding and not ex.program_running:
                        cur.done = True
                        return None
                else:
                    item = self._next_var_piece(cur)
                    if item is not None:
                        return item
                    if cur.done:
                        return None
                if not ex.cond.wait(timeout):
                    return None, None

    def _next_var_piece(self, cur: _Cursor) -> tuple[str, dict[str, Any]] | None:
        ex = self.executor
        name = cur.var
        chunks = ex.stream_chunks.get(name)
        produced = name in ex.variables and name not in ex.pending
        if chunks is None:
            if produced:  # set without streaming (a select, n > 1, s[name] = v)
                cur.done = True
                return ex.variables[name], ex.meta_info.get(name)
            if ex.error_ is not None:
                raise ex.error_
            if name not in ex.pending and not ex.program_running:
                raise KeyError(name)
            return None
        if cur.idx < len(chunks):
            text = ""
            final = None
            for chunk in chunks[cur.idx:]:
                text += chunk.text
                cur.held_ids += chunk.token_ids
                if chunk.logprobs is not None:
                    cur.held_logprobs += chunk.logprobs
                if chunk.top_logprobs is not None:
                    cur.held_top += chunk.top_logprobs
                if chunk.finished:
                    final = chunk.meta_info
            cur.idx = len(chunks)
            if text or final is not None:
                meta = dict(final or {})
                cur.completion_tokens += len(cur.held_ids)
                meta["output_token_ids"] = cur.held_ids
                if cur.held_logprobs:
                    meta["output_token_logprobs"] = cur.held_logprobs
                if cur.held_top:
                    meta["output_top_logprobs"] = cur.held_top
                meta["completion_tokens"] = cur.completion_tokens
                cur.held_ids, cur.held_logprobs, cur.held_top = [], [], []
                if final is not None:
                    cur.done = True
                return text, meta
        if produced or ex.error_ is not None:
            if ex.error_ is not None and not produced:
                raise ex.error_
            cur.done = True
        return None

    def __repr__(self) -> str:
        """``ProgramState(<the whole text>)``, as SGLang prints it (after everything queued has
        run; a failed program shows the text it reached)."""
        self.executor.sync()
        return f"ProgramState({self.executor.transcript.text})"


def run_program(func: Callable[..., Any], state: ProgramState, args: tuple, kwargs: dict,
                capture: bool) -> None:
    """Call the program function on ``state``; mark the program finished afterwards.

    With ``capture``, an exception from the function is stored in the state (readers raise it)
    instead of propagating.
    """
    ex = state.executor
    with ex.cond:
        ex.program_thread = threading.get_ident()
        ex.program_running = True
    try:
        ex.ret_value = func(state, *args, **kwargs)
    except BaseException as e:  # noqa: BLE001
        ex.set_error(e)
        if not capture:
            raise
    finally:
        with ex.cond:
            ex.program_running = False
            ex.cond.notify_all()
