"""The worker behind each program state: a :class:`StreamExecutor` runs a state's queued
expressions in order against the backend on its own thread (a thread lives only while its queue
has work), holds the variables and the transcript, and forks into sibling executors whose
requests reach the engine together. :mod:`sgrt.lang.interpreter` has the ``ProgramState`` that
programs see and the error rules.
"""
from __future__ import annotations

import threading
import uuid
from collections import deque
from typing import Any

from sgrt.backends.base import BaseBackend, GenChunk
from sgrt.chat_template import ChatTemplate
from sgrt.errors import InvalidRequest
from sgrt.lang import ir
from sgrt.lang.choices import token_length_normalized
from sgrt.lang.defaults import gen_sampling_params, parse_dtype_value
from sgrt.lang.meta_info import gen_meta, select_method_inputs, strip_texts
from sgrt.lang.transcript import Transcript
from sgrt.sampling_params import SamplingParams


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

    def _gen_params(self, expr: ir.Gen) -> tuple[SamplingParams, int, dict[str, Any]]:
        """The backend params (built and checked once, here), n and the DSL-only options of
        one ``gen``."""
        from sgrt.global_config import global_config

        n = expr.n if expr.n is not None else int(self.run_options.get("n", 1))
        params, dsl = gen_sampling_params(
            self.run_options, expr.params, expr.dtype, n=n, name=expr.name,
            skip_special_tokens=global_config.skip_special_tokens_in_output)
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
        with_text = dsl["return_text_in_logprobs"]
        if n > 1:
            outs = self.backend.generate_batch([prompt] * n, [params] * n)
            metas = [gen_meta(o.meta_info, params, with_text) for o in outs]
            self._record_usage(metas)
            self._fill(outs[0].text)
            if name is not None:
                self.set_var(name, [o.text for o in outs], metas)
            return
        rid = self._new_request_id()
        self._request_ids.add(rid)
        try:
            if self.stream:
                meta = self._stream_gen(prompt, params, rid, name, with_text)
                text = self.variables.get(name, "") if name is not None else None
            else:
                out = self.backend.generate(prompt, params, request_id=rid)
                self._fill(out.text)
                text, meta = out.text, gen_meta(out.meta_info, params, with_text)
        finally:
            self._request_ids.discard(rid)
        self._record_usage([meta])
        if expr.dtype is not None and meta is not None:
            meta["value"] = parse_dtype_value(expr.dtype, text or "")
        if name is not None:
            self.set_var(name, text, meta)

    def _stream_gen(self, prompt: str, params: SamplingParams, rid: str,
                    name: str | None, with_text: bool | None = None) -> dict[str, Any] | None:
        """Stream one gen into the transcript (and variable ``name``); returns the final meta
        info, shaped for programs (the last chunk carries the same dict)."""
        if name is not None:
            with self.cond:
                self.variables[name] = ""
                self.stream_chunks[name] = []
        meta = None
        for chunk in self.backend.generate_stream(prompt, params, request_id=rid):
            if with_text is False:
                chunk.logprobs = strip_texts(chunk.logprobs)
                chunk.top_logprobs = ([strip_texts(row) for row in chunk.top_logprobs]
                                      if chunk.top_logprobs is not None else None)
            if chunk.finished:
                chunk.meta_info = meta = gen_meta(chunk.meta_info, params, with_text)
            with self.cond:
                self.transcript.fill(chunk.text)
                if name is not None:
                    self.variables[name] += chunk.text
                    self.stream_chunks[name].append(chunk)
                self.cond.notify_all()
        return meta

    def _execute_select(self, expr: ir.Select) -> None:
        """SGLang's select: score the options, call the choices method with SGLang's keyword
        arguments, record its decision and meta info (over the scoring's own keys)."""
        method = expr.choices_method or token_length_normalized
        unconditional = bool(getattr(method, "requires_unconditional_logprobs", False))
        scores = self.backend.score_choices(self.transcript.text, expr.choices,
                                            unconditional=unconditional)
        inputs = select_method_inputs(scores, unconditional)
        decision = method(choices=list(expr.choices), **inputs)
        meta = {k: v for k, v in inputs.items() if v is not None}
        meta.update(decision.meta_info or {})
        meta["choices"] = list(expr.choices)
        meta["decision"] = decision.decision
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

