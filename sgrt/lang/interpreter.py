"""Runs programs: ``ProgramState`` (what ``s`` is) over a ``StreamExecutor`` per state.

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
import uuid
import warnings
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from sgrt.backends.base import BaseBackend, GenChunk
from sgrt.chat_template import ChatTemplate
from sgrt.errors import InvalidRequest
from sgrt.lang import ir
from sgrt.lang.choices import token_length_normalized
from sgrt.lang.defaults import (
    DSL_ONLY_KEYS,
    SGLANG_DEFAULT_TEMPERATURE,
    parse_dtype_value,
    resolve_gen_params,
)
from sgrt.lang.transcript import Transcript


class StreamExecutor:
    """Executes one state's expressions in order on a worker thread.

    All mutable fields are guarded by ``cond`` (a ``threading.Condition``); readers wait on it.
    """

    def __init__(self, backend: BaseBackend, run_options: dict[str, Any], template: ChatTemplate,
                 stream: bool = False):
        self.sid = uuid.uuid4().hex
        self.backend = backend
        self.run_options = run_options
        self.stream = stream
        self.transcript = Transcript(template)
        self.variables: dict[str, Any] = {}
        self.meta_info: dict[str, Any] = {}
        self.pending: set[str] = set()  # variables submitted but not yet produced
        self.scope_starts: dict[str, int] = {}
        self.stream_chunks: dict[str, list[GenChunk]] = {}
        self.error_: BaseException | None = None
        self.fork_start_text_pos = 0
        self.fork_commit_meta: dict[str, Any] | None = None
        self.ret_value: Any = None
        # The thread running the program function; a reader on another thread waits for
        # variables the program has not submitted yet while ``program_running``.
        self.program_thread: int | None = None
        self.program_running = False
        self.cond = threading.Condition()
        self._items: deque[ir.Expr] = deque()
        self._outstanding = 0
        self._worker_alive = False
        self._request_ids: set[str] = set()
        self._gen_count = 0

    # ---- queue ----------------------------------------------------------------------------

    def submit(self, expr: Any) -> None:
        """Queue ``expr`` (anything :func:`sgrt.lang.ir.to_expr` takes); returns at once."""
        expr = ir.to_expr(expr)
        with self.cond:
            self.pending.update(ir.var_names(expr))
            self._items.append(expr)
            self._outstanding += 1
            if not self._worker_alive:
                self._worker_alive = True
                threading.Thread(target=self._work, name=f"sgrt-exec-{self.sid[:8]}",
                                 daemon=True).start()

    def _work(self) -> None:
        while True:
            with self.cond:
                if not self._items:
                    self._worker_alive = False
                    self.cond.notify_all()
                    return
                expr = self._items.popleft()
                failed = self.error_ is not None
            if not failed:
                try:
                    self._execute(expr)
                except BaseException as e:  # noqa: BLE001 - stored and re-raised to readers
                    self.set_error(e)
            with self.cond:
                self._outstanding -= 1
                self.cond.notify_all()

    def set_error(self, error: BaseException) -> None:
        """Record the first error and wake every reader."""
        with self.cond:
            if self.error_ is None:
                self.error_ = error
            self.cond.notify_all()

    def sync(self) -> None:
        """Wait until every queued expression has run (or been skipped after an error).

        From a thread other than the program's, also wait for a running program function to
        return (``run(stream=True)``), so that ``s.text()`` there is the final text.
        """
        with self.cond:
            while self._outstanding or self._awaits_program():
                self.cond.wait()

    def _awaits_program(self) -> bool:
        return self.program_running and threading.get_ident() != self.program_thread

    def finished(self) -> bool:
        with self.cond:
            return not self._outstanding and not self.program_running

    def raise_if_failed(self) -> None:
        if self.error_ is not None:
            raise self.error_

    # ---- reading --------------------------------------------------------------------------

    def get_var(self, name: str) -> Any:
        """The value of variable ``name``, waiting until it is produced.

        Raises:
            KeyError: no such variable is set or queued (and no program still running could
                queue it).
            Exception: the error that stopped the program before it produced ``name``.
        """
        with self.cond:
            while True:
                if name in self.variables and name not in self.pending:
                    return self.variables[name]
                if self.error_ is not None:
                    raise self.error_
                if name not in self.pending and not self._awaits_program():
                    raise KeyError(name)
                self.cond.wait()

    def get_meta_info(self, name: str) -> Any:
        """The meta info recorded for variable ``name`` (waits like :meth:`get_var`)."""
        self.get_var(name)
        with self.cond:
            return self.meta_info.get(name)

    def set_var(self, name: str, value: Any, meta: Any = None) -> None:
        with self.cond:
            self.variables[name] = value
            if meta is not None:
                self.meta_info[name] = meta
            self.pending.discard(name)
            self.cond.notify_all()

    # ---- execution ------------------------------------------------------------------------

    def _execute(self, expr: ir.Expr) -> None:
        for leaf in expr.flatten():
            if self.error_ is not None:
                return
            if isinstance(leaf, ir.ConstantText):
                self._fill(leaf.value)
            elif isinstance(leaf, ir.RoleBegin):
                with self.cond:
                    self.transcript.begin_role(leaf.role)
                    self.cond.notify_all()
            elif isinstance(leaf, ir.RoleEnd):
                with self.cond:
                    self.transcript.end_role(leaf.role)
                    self.cond.notify_all()
            elif isinstance(leaf, ir.Gen):
                self._execute_gen(leaf)
            elif isinstance(leaf, ir.Select):
                self._execute_select(leaf)
            elif isinstance(leaf, ir.VarScopeBegin):
                with self.cond:
                    self.scope_starts[leaf.name] = len(self.transcript.text)
            elif isinstance(leaf, ir.VarScopeEnd):
                start = self.scope_starts.pop(leaf.name, None)
                if start is None:
                    raise InvalidRequest(f"var_scope {leaf.name!r} ended but never begun",
                                         field="var_scope")
                self.set_var(leaf.name, self.transcript.text[start:])
            elif isinstance(leaf, ir.CommitPrefix):
                if self.transcript.text:
                    self.fork_commit_meta = self.backend.commit_fork(self.transcript.text,
                                                                     leaf.num_branches)
            elif isinstance(leaf, ir.AppendForks):
                self._execute_append_forks(leaf)
            elif isinstance(leaf, (ir.Image, ir.Video)):
                self._refuse_vision(leaf)
            elif isinstance(leaf, ir.SeparateReasoning):
                self._execute_separate_reasoning(leaf)
            else:
                raise TypeError(f"cannot execute {leaf!r} (a tracing placeholder in a real run?)")

    def _fill(self, text: str) -> None:
        with self.cond:
            self.transcript.fill(text)
            self.cond.notify_all()

    def _new_request_id(self) -> str:
        self._gen_count += 1
        return f"{self.sid}-{self._gen_count}"

    def _gen_params(self, expr: ir.Gen) -> tuple[dict[str, Any], int, dict[str, Any]]:
        """The backend params, n and the DSL-only options of one ``gen``."""
        from sgrt.global_config import global_config

        params = resolve_gen_params(self.run_options, expr.params, expr.dtype)
        dsl = {k: params.pop(k) for k in DSL_ONLY_KEYS}
        n = expr.n if expr.n is not None else int(self.run_options.get("n", 1))
        if n > 1 and "temperature" not in expr.params and "temperature" not in self.run_options:
            # NOTE: greedy decoding (sgrt's default) would make the n completions identical;
            # SGLang samples at its run() default here, and so do we, saying so.
            params["temperature"] = SGLANG_DEFAULT_TEMPERATURE
            warnings.warn(
                f"gen({expr.name!r}, n={n}) sets no temperature: sampling at SGLang's default "
                f"temperature={SGLANG_DEFAULT_TEMPERATURE} (sgrt's greedy default would return "
                f"{n} identical completions); pass temperature=... to choose", UserWarning,
                stacklevel=2)
        if not global_config.skip_special_tokens_in_output:
            params.setdefault("skip_special_tokens", False)
        return params, n, dsl

    def _record_usage(self, metas: list[Any]) -> None:
        usage = getattr(self.backend, "token_usage", None)
        if usage is None:
            return
        for meta in metas:
            if isinstance(meta, dict):
                usage.add(meta.get("prompt_tokens"), meta.get("completion_tokens"))

    def _execute_gen(self, expr: ir.Gen) -> None:
        params, n, dsl = self._gen_params(expr)
        prompt = self.transcript.text
        name = expr.name
        if n > 1:
            outs = self.backend.generate_batch([prompt] * n, [params] * n)
            metas = [_logprob_text(o.meta_info, dsl["return_text_in_logprobs"]) for o in outs]
            self._record_usage(metas)
            self._fill(outs[0].text)
            if name is not None:
                self.set_var(name, [o.text for o in outs], metas)
            return
        rid = self._new_request_id()
        self._request_ids.add(rid)
        try:
            if self.stream:
                meta = self._stream_gen(prompt, params, rid, name, dsl["return_text_in_logprobs"])
                text = self.variables.get(name, "") if name is not None else None
            else:
                out = self.backend.generate(prompt, params, request_id=rid)
                self._fill(out.text)
                text, meta = out.text, out.meta_info
        finally:
            self._request_ids.discard(rid)
        meta = _logprob_text(meta, dsl["return_text_in_logprobs"])
        self._record_usage([meta])
        if expr.dtype is not None and meta is not None:
            meta["value"] = parse_dtype_value(expr.dtype, text or "")
        if name is not None:
            self.set_var(name, text, meta)

    def _stream_gen(self, prompt: str, params: dict[str, Any], rid: str,
                    name: str | None, with_text: bool | None = None) -> dict[str, Any] | None:
        if name is not None:
            with self.cond:
                self.variables[name] = ""
                self.stream_chunks[name] = []
        meta = None
        for chunk in self.backend.generate_stream(prompt, params, request_id=rid):
            if with_text is False:
                chunk.logprobs = _strip_texts(chunk.logprobs)
                chunk.top_logprobs = ([_strip_texts(row) for row in chunk.top_logprobs]
                                      if chunk.top_logprobs is not None else None)
            with self.cond:
                self.transcript.fill(chunk.text)
                if name is not None:
                    self.variables[name] += chunk.text
                    self.stream_chunks[name].append(chunk)
                if chunk.finished:
                    meta = chunk.meta_info
                self.cond.notify_all()
        return meta

    def _execute_select(self, expr: ir.Select) -> None:
        method = expr.choices_method or token_length_normalized
        scores = self.backend.score_choices(
            self.transcript.text, expr.choices,
            unconditional=getattr(method, "requires_unconditional_logprobs", False))
        decision = method(
            choices=list(expr.choices),
            token_logprobs=[sc.token_logprobs for sc in scores],
            unconditional_token_logprobs=(
                [sc.unconditional_logprobs for sc in scores]
                if getattr(method, "requires_unconditional_logprobs", False) else None),
        )
        meta = dict(decision.meta_info)
        meta["choices"] = list(expr.choices)
        meta["decision"] = decision.decision
        meta["input_token_logprobs"] = [
            list(zip(sc.token_logprobs, sc.token_ids, sc.token_texts or [None] * len(sc.token_ids)))
            for sc in scores]
        meta["prompt_tokens"] = [sc.prompt_tokens for sc in scores]
        meta["cached_tokens"] = [sc.cached_tokens for sc in scores]
        self._record_usage([{"prompt_tokens": sc.prompt_tokens} for sc in scores])
        self._fill(decision.decision)
        if expr.name is not None:
            self.set_var(expr.name, decision.decision, meta)

    def _refuse_vision(self, leaf: ir.Expr) -> None:
        what = "image" if isinstance(leaf, ir.Image) else "video"
        try:
            model = self.backend.get_model_name() or type(self.backend).__name__
        except Exception:  # noqa: BLE001 - the name only decorates the message
            model = type(self.backend).__name__
        raise InvalidRequest(
            f"sgrt.{what}({leaf.path!r}): the loaded model ({model}) has no vision tower, so it "
            f"cannot take {what} input; sgrt loads text-only models", field=what)

    def _execute_separate_reasoning(self, leaf: ir.SeparateReasoning) -> None:
        """SGLang's ``separate_reasoning``: split each target variable, and make the open
        message's text the answer alone (outside a message: replace the generated tail)."""
        from sgrt.lang.reasoning import split_reasoning

        for name in leaf.targets:
            with self.cond:
                value = self.variables.get(name)
                meta = self.meta_info.get(name)
            if isinstance(value, list):  # n > 1: split every completion
                pairs = [split_reasoning(v, leaf.model_type) for v in value]
                self.set_var(ir.reasoning_var_name(name), [r for r, _ in pairs])
                self.set_var(name, [a for _, a in pairs], meta)
                value, answer = value[0], pairs[0][1]
            else:
                reasoning, answer = split_reasoning(value or "", leaf.model_type)
                self.set_var(ir.reasoning_var_name(name), reasoning)
                self.set_var(name, answer, meta)
            with self.cond:
                t = self.transcript
                if t.cur_role is not None:
                    t.text = t.text[:t.role_begin_pos] + answer
                elif value and t.text.endswith(value):
                    t.text = t.text[:len(t.text) - len(value)] + answer
                self.cond.notify_all()

    def _execute_append_forks(self, expr: ir.AppendForks) -> None:
        pieces = []
        for state in expr.states:
            child: StreamExecutor = state.executor
            child.sync()
            child.raise_if_failed()
            pieces.append(child.transcript.text[child.fork_start_text_pos:])
        self._fill("".join(pieces))

    # ---- fork -----------------------------------------------------------------------------

    def fork(self, size: int, position_ids_offset: Any = None) -> list["StreamExecutor"]:
        """``size`` new executors continuing from this one's text (after committing it).

        With ``size > 1`` the text so far is first committed to the backend's prefix cache, so
        that every branch prefills only its own tokens. ``position_ids_offset`` (SGLang's
        argument) must be ``None`` or one int per branch; it has no effect, as in SGLang's
        interpreter, which accepts it and never reads it.

        Raises:
            InvalidRequest: (field ``size``) size < 1; (field ``position_ids_offset``) not
                ``None`` nor ``size`` ints.
            Exception: the error that stopped this state before the fork.
        """
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise InvalidRequest(f"fork size must be an int >= 1, got {size!r}", field="size")
        if position_ids_offset is not None and (
                not isinstance(position_ids_offset, (list, tuple))
                or len(position_ids_offset) != size
                or not all(isinstance(x, int) and not isinstance(x, bool) for x in position_ids_offset)):
            raise InvalidRequest(
                f"position_ids_offset must be None or {size} ints (one per branch), "
                f"got {position_ids_offset!r}", field="position_ids_offset")
        if size > 1:
            self.submit(ir.CommitPrefix(size))
        with self.cond:
            while self._outstanding:
                self.cond.wait()
            self.raise_if_failed()
            children = []
            for _ in range(size):
                child = StreamExecutor(self.backend, self.run_options, self.transcript.template,
                                       self.stream)
                child.transcript = self.transcript.copy()
                child.variables = dict(self.variables)
                child.meta_info = dict(self.meta_info)
                child.fork_start_text_pos = len(self.transcript.text)
                children.append(child)
        return children

    def abort(self) -> None:
        """Abort this state's running requests; the program fails with ``RequestAborted``."""
        from sgrt.errors import RequestAborted

        self.set_error(RequestAborted("program aborted by the caller"))
        for rid in list(self._request_ids):
            self.backend.abort(rid)


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

        On exit the branch is finished and the variables it created are copied to ``s``.
        """
        group = self.fork(1, position_ids_offset)
        yield group[0]
        group.join(mode="copy")

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
        if isinstance(other, (list, tuple)):
            if len(other) != len(self.states):
                raise InvalidRequest(
                    f"forks += list needs one entry per branch ({len(self.states)}), "
                    f"got {len(other)}", field="forks")
            for state, x in zip(self.states, other):
                state += x
        elif callable(other) and not isinstance(other, ir.Expr):
            for i, state in enumerate(self.states):
                state += other(i)
        else:
            for state in self.states:
                state += other
        return self

    def join(self, mode: str = "gather_variable") -> None:
        """Wait for every branch and merge them into the parent.

        ``"gather_variable"`` (default): each variable the branches created becomes, on the
        parent, the list of its per-branch values (``s["x"][i]``). ``"concate_and_append"``:
        additionally the branches' texts are appended to the parent's text, in order.

        Raises:
            InvalidRequest: (field ``mode``) another mode.
            Exception: the first branch's error, if a branch failed.
        """
        if mode not in ("gather_variable", "concate_and_append", "copy"):
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
            if mode == "copy":
                child = self.states[0].executor
                parent.set_var(name, child.variables[name], child.meta_info.get(name))
            else:
                parent.set_var(name, [s.executor.variables.get(name) for s in self.states],
                               [s.executor.meta_info.get(name) for s in self.states])
        if mode == "concate_and_append":
            parent.submit(ir.AppendForks(list(self.states)))


def _strip_texts(rows: Any) -> Any:
    if rows is None:
        return None
    return [(e[0], e[1], None) if isinstance(e, (tuple, list)) and len(e) == 3 else e for e in rows]


def _logprob_text(meta: Any, with_text: bool | None) -> Any:
    """``meta`` with the token texts of its log-probability entries set to ``None`` when
    ``return_text_in_logprobs=False`` was given (SGLang's shape); unchanged otherwise."""
    if with_text is not False or not isinstance(meta, dict):
        return meta
    out = dict(meta)
    if out.get("output_token_logprobs") is not None:
        out["output_token_logprobs"] = _strip_texts(out["output_token_logprobs"])
    if out.get("output_top_logprobs") is not None:
        out["output_top_logprobs"] = [_strip_texts(row) for row in out["output_top_logprobs"]]
    return out


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
