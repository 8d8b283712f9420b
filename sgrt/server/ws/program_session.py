"""A session that runs one registered program by name over the WebSocket protocol (the base
class and the rules every session shares are in :mod:`sgrt.server.ws.session`).
"""
from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any

from sgrt.errors import CapacityError, InvalidRequest, RequestAborted
from sgrt.server.ws import protocol as p
from sgrt.server.ws.programs import check_program_args
from sgrt.server.ws.session import Session, SessionContext, in_thread, ws_sampling_params

logger = logging.getLogger("sgrt.server")


class ProgramSession(Session):
    """One run of a program registered on the server, with the session's arguments."""

    kind = "program"

    def __init__(self, sid: str, ctx: SessionContext, start: p.SessionStart, program: Any):
        super().__init__(sid, ctx, start)
        if start.tools:
            raise InvalidRequest("tools are for chat sessions; a program defines its own", field="tools")
        self.program = program
        # NOTE: a wrong argument type is the client's error, answered before the program runs
        # (not a program_failed from deep inside it).
        self.args = check_program_args(program, start.args)
        ws_sampling_params({}, start.sampling, self.limits)  # refuse bad sampling at session.start
        # NOTE: the run() options every gen inherits: what the client set (each gen keeps its own
        # max_tokens unless the client set one; checked per call).
        self.sampling = start.sampling.fields_set() if start.sampling else {}
        self.run: Any = None

    async def on_start(self) -> None:
        self._spawn(self._run())

    async def on_cancel(self) -> None:
        if self.busy:
            self._cancel_requested = True
            self._abort_running()
            return
        await self.send(p.Done(session=self.id, turn=self.turn, reason="cancelled"))

    def _abort_running(self) -> None:
        if self.run is not None:
            self.run.abort()

    async def _run(self) -> None:
        from sgrt.server.ws.programs import ProgramRun

        self.turn = 1
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def on_text(text: str) -> None:  # called on the program's threads
            loop.call_soon_threadsafe(queue.put_nowait, text)

        self.run = ProgramRun(self.ctx.program_backend(on_text), self.program, self.args, self.sampling)
        self.run.start()
        if self._cancel_requested:
            self.run.abort()
        done = in_thread(self.run.wait, name=f"sgrt-program-wait-{self.id}")
        getter: asyncio.Task | None = None
        try:
            while True:
                getter = loop.create_task(queue.get())
                finished, _ = await asyncio.wait({getter, done}, return_when=asyncio.FIRST_COMPLETED)
                if getter in finished:
                    await self.send(p.Token(session=self.id, turn=1, text=getter.result()))
                    continue
                while not queue.empty():
                    await self.send(p.Token(session=self.id, turn=1, text=queue.get_nowait()))
                break
        except BaseException:
            self.run.abort()  # disconnect or close: stop the program's requests
            raise
        finally:
            if getter is not None:
                getter.cancel()
        report = done.result()
        await self.send(p.Message(
            session=self.id, turn=1, content=report.text, finish_reason=report.finish_reason,
            ttft=report.ttft, prompt_tokens=report.prompt_tokens, completion_tokens=report.completion_tokens,
            cached_tokens=report.cached_tokens, outputs=report.outputs))
        if report.error is not None and not isinstance(report.error, RequestAborted):
            if isinstance(report.error, (InvalidRequest, CapacityError)):
                await self.send_error(report.error)
            elif type(report.error) is ValueError:
                # NOTE: how registered programs refuse their arguments ("n must be in 2..9"): the
                # program's own words, shown; any other exception's text stays in the log.
                await self.send(p.Error(code="invalid_request", session=self.id, field="args",
                                        message=f"the program refused its arguments: {str(report.error)[:300]}"))
            else:
                incident = uuid.uuid4().hex[:12]
                logger.error("session %s: program failed (incident %s)", self.id, incident, exc_info=report.error)
                await self.send(p.Error(code="program_failed", session=self.id,
                                        message=f"the program raised {type(report.error).__name__} (incident "
                                                f"{incident}; details in the server log)"))
            await self.send(p.Done(session=self.id, turn=1, reason="error"))
            return
        reason = "cancelled" if self._cancel_requested else "program"
        await self.send(p.Done(session=self.id, turn=1, reason=reason))
