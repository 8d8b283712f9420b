"""``sgrt chat``: an interactive conversation with a loaded engine, as ``ollama run`` has it.

One message per Enter. On a terminal the line is edited with prompt_toolkit (history, cursor
keys): a paste is one message (bracketed paste: its newlines and blank lines stay in the line
until Enter), and a message that starts with ``\"\"\"`` goes on over several lines until one
ends with ``\"\"\"`` (Enter adds a line meanwhile). A single line that starts with ``/`` is a
command (:data:`COMMANDS`; ``//`` sends one ``/``). Ctrl-C during an answer stops that answer
and keeps the conversation (the partial answer stays in it, as the user saw it); Ctrl-C at the
prompt clears the line; Ctrl-D (end of input) or ``/bye`` ends the chat. Answers go to stdout,
everything else to stderr. Off a terminal each input line is a message (``\"\"\"`` blocks
too) and no prompt is shown.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Callable, TextIO

from sgrt.errors import ContextLengthExceeded, SgrtError, one_line

PROMPT = ">>> "
CONTINUATION = "... "
BLOCK = '"""'

COMMANDS = {
    "/help": "this list",
    "/clear": "forget the conversation (the system prompt stays)",
    "/system TEXT": "set the system prompt (no TEXT: show it)",
    "/set NAME VALUE": "a sampling setting: temperature, top_p, top_k, min_p, repeat_penalty, max_tokens, seed",
    "/set verbose | quiet": "print stats after every answer, or not",
    "/set": "show the settings",
    "/stats": "the last answer's stats and the conversation's totals",
    "/bye": "end the chat (also Ctrl-D)",
}

# /set NAME -> (SamplingParams field, parser of the value text)
_SETTINGS: dict[str, tuple[str, Callable[[str], Any]]] = {
    "temperature": ("temperature", float),
    "top_p": ("top_p", float),
    "top_k": ("top_k", int),
    "min_p": ("min_p", float),
    "repeat_penalty": ("repetition_penalty", float),
    "repetition_penalty": ("repetition_penalty", float),
    "max_tokens": ("max_tokens", int),
    "num_predict": ("max_tokens", int),  # (ollama's name)
    "seed": ("seed", lambda text: None if text.lower() in ("none", "off") else int(text)),
}


@dataclass
class TurnStats:
    """One answer's figures (times in seconds)."""

    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    ttft: float | None
    total_time: float
    tok_per_s: float
    finish_reason: str | None
    interrupted: bool

    def line(self) -> str:
        """One line for a person."""
        ttft = "-" if self.ttft is None else f"{1000 * self.ttft:.0f} ms"
        end = "stopped by Ctrl-C" if self.interrupted else f"finish_reason={self.finish_reason}"
        return (f"{self.completion_tokens} tokens in {self.total_time:.2f} s ({self.tok_per_s:.1f} tok/s), "
                f"TTFT {ttft}, prompt {self.prompt_tokens} tokens ({self.cached_tokens} cached), {end}")


class ChatRepl:
    """The read-answer loop of ``sgrt chat`` (module docstring).

    Args:
        engine: a running :class:`sgrt.engine.Engine` whose tokenizer has a chat template.
        params: the :class:`sgrt.sampling_params.SamplingParams` of each answer (``/set`` replaces
            fields of it).
        system: the system prompt, or None.
        verbose: print each answer's stats.
        stdin, stdout, stderr: the streams (a terminal stdin turns on readline and the prompt).
    """

    def __init__(self, engine: Any, params: Any, system: str | None = None, verbose: bool = False,
                 stdin: TextIO | None = None, stdout: TextIO | None = None, stderr: TextIO | None = None):
        self.engine = engine
        self.params = params
        self.system = system
        self.verbose = verbose
        self.stdin = stdin or sys.stdin
        self.stdout = stdout or sys.stdout
        self.stderr = stderr or sys.stderr
        # (prompt_toolkit edits lines on the process's own terminal: both ends must be one)
        self.interactive = (self.stdin is sys.stdin and self.stdout is sys.stdout
                            and _isatty(self.stdin) and _isatty(self.stdout))
        self.history: list[dict[str, str]] = []
        self.turns: list[TurnStats] = []
        self._session: Any = None

    # ---- the loop ------------------------------------------------------------------------------
    def run(self) -> int:
        """Read and answer messages until end of input or ``/bye``; returns the exit status (0).
        A Ctrl-C anywhere but in an answer (at the prompt, between turns) drops what was being
        read or done and the chat goes on."""
        while True:
            try:
                if not self.turn():
                    return 0
            except KeyboardInterrupt:
                self._note("\n(Ctrl-D or /bye ends the chat)")

    def turn(self) -> bool:
        """Read one message and answer it (or run its command); False when the chat ends."""
        text = self.read_message()
        if text is None:
            return False
        stripped = text.strip()
        if not stripped:
            return True
        if stripped.startswith("/") and "\n" not in stripped:
            if not stripped.startswith("//"):
                return self.command(stripped)
            text = stripped[1:]
        self.answer(text)
        return True

    def read_message(self) -> str | None:
        """The next message (a line, a whole paste, or a ``\"\"\"`` block, quotes removed); None
        at end of input.

        Raises:
            KeyboardInterrupt: Ctrl-C while reading (the caller drops the line).
        """
        text = self._read_terminal() if self.interactive else self._read_lines()
        if text is None:
            return None
        head = text.lstrip()
        if not head.startswith(BLOCK):
            return text
        body = head[len(BLOCK):].rstrip()
        if body.endswith(BLOCK):
            body = body[:-len(BLOCK)]
        return body.strip("\n")

    def _read_terminal(self) -> str | None:
        if self._session is None:
            self._session = _prompt_session()
        try:
            return self._session.prompt(PROMPT)
        except EOFError:
            return None

    def _read_lines(self) -> str | None:
        """One line, or the lines of a ``\"\"\"`` block, from a non-terminal stdin."""
        line = self.stdin.readline()
        if line == "":
            return None
        lines = [line.rstrip("\n")]
        while _open_block("\n".join(lines)):
            nxt = self.stdin.readline()
            if nxt == "":  # end of input inside a block: send what came
                break
            lines.append(nxt.rstrip("\n"))
        return "\n".join(lines)

    # ---- answers -------------------------------------------------------------------------------
    def messages(self) -> list[dict[str, str]]:
        """The conversation as chat messages (the system prompt first, if any)."""
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + self.history

    def answer(self, text: str) -> None:
        """Stream the model's answer to ``text``; Ctrl-C stops it and keeps what came."""
        user = {"role": "user", "content": text}
        try:
            prompt = self.engine.tokenizer.apply_chat_template(self.messages() + [user])
        except Exception as e:  # noqa: BLE001 - a template's own errors are of any type
            self._error(f"the chat template refused the conversation: {_flat(e)}")
            return
        pieces: list[str] = []
        result = None
        interrupted = False
        handle = None
        try:
            try:
                handle = self.engine.submit(prompt, self.params)
            except ContextLengthExceeded as e:
                self._error(f"{_flat(e)} (/clear starts a new conversation)")
                return
            except SgrtError as e:
                self._error(_flat(e))
                return
            for chunk in handle:
                if chunk.text:
                    self.stdout.write(chunk.text)
                    self.stdout.flush()
                    pieces.append(chunk.text)
                if chunk.finished:
                    result = chunk.result
        except KeyboardInterrupt:
            if handle is None:  # (before the request was queued: nothing to stop)
                raise
            interrupted = True
            result = self._stop(handle)
        self.stdout.write("\n")
        self.stdout.flush()
        self.history += [user, {"role": "assistant", "content": "".join(pieces)}]
        if result is not None:
            self.turns.append(TurnStats(result.prompt_tokens, result.cached_tokens, result.completion_tokens,
                                        result.ttft, result.total_time, result.output_tok_per_s,
                                        result.finish_reason, interrupted))
        if interrupted:
            self._note("[sgrt] answer stopped; the conversation goes on")
        elif result is not None and result.finish_reason == "abort":
            self._error(f"the answer failed: {result.error or 'no reason given'}")
        if self.verbose and self.turns:
            self._note(f"[sgrt] {self.turns[-1].line()}")

    @staticmethod
    def _stop(handle: Any) -> Any:
        """Abort ``handle``'s request and wait for its final result (a second Ctrl-C aborts
        again and keeps waiting: the engine frees the request's slots within a step)."""
        handle.abort()
        while True:
            try:
                return handle.result()
            except KeyboardInterrupt:
                handle.abort()
            except SgrtError:
                return None

    # ---- commands ------------------------------------------------------------------------------
    def command(self, line: str) -> bool:
        """Run a slash command; False when the chat should end."""
        name, _, rest = line.partition(" ")
        rest = rest.strip()
        name = name.lower()
        if name in ("/bye", "/exit", "/quit"):
            return False
        if name in ("/help", "/?"):
            width = max(len(k) for k in COMMANDS)
            lines = [f"  {k.ljust(width)}  {v}" for k, v in COMMANDS.items()]
            lines += ['  """ ... """' .ljust(width + 2) + "  a multi-line message (a paste is one message too)",
                      "  //text".ljust(width + 2) + "  a message that starts with /",
                      "  Ctrl-C".ljust(width + 2) + "  stop the answer (the conversation stays)"]
            self._note("\n".join(lines))
        elif name == "/clear":
            self.history.clear()
            self._note("[sgrt] conversation cleared")
        elif name == "/system":
            if rest:
                self.system = rest
                self._note("[sgrt] system prompt set")
            else:
                self._note(f"[sgrt] system prompt: {self.system!r}" if self.system else "[sgrt] no system prompt")
        elif name == "/set":
            self._set(rest)
        elif name == "/stats":
            self._stats()
        else:
            self._error(f"unknown command {name} (/help lists them; //text sends text that starts with /)")
        return True

    def _set(self, rest: str) -> None:
        if not rest:
            p = self.params
            self._note(f"[sgrt] temperature={p.temperature} top_p={p.top_p} top_k={p.top_k} min_p={p.min_p} "
                       f"repeat_penalty={p.repetition_penalty} max_tokens={p.max_tokens} seed={p.seed} "
                       f"verbose={'on' if self.verbose else 'off'}")
            return
        key, _, value = rest.partition(" ")
        key = key.lower().replace("-", "_")
        if key in ("verbose", "quiet") and not value.strip():
            self.verbose = key == "verbose"
            self._note(f"[sgrt] stats after each answer: {'on' if self.verbose else 'off'}")
            return
        if key == "parameter":  # ollama's "/set parameter NAME VALUE"
            key, _, value = value.strip().partition(" ")
            key = key.lower().replace("-", "_")
        if key not in _SETTINGS:
            self._error(f"/set: unknown setting {key!r}; settings: {', '.join(sorted(_SETTINGS))}, verbose, quiet")
            return
        field, parse = _SETTINGS[key]
        value = value.strip()
        try:
            parsed = parse(value)
        except ValueError:
            self._error(f"/set {key}: {value!r} is not a valid value")
            return
        try:
            self.params = self.params.replace(**{field: parsed})
        except SgrtError as e:
            self._error(f"/set {key}: {_flat(e)}")
            return
        self._note(f"[sgrt] {key} = {parsed}")

    def _stats(self) -> None:
        if not self.turns:
            self._note("[sgrt] no answer yet")
            return
        stopped = sum(t.interrupted for t in self.turns)
        self._note(f"[sgrt] last answer: {self.turns[-1].line()}\n"
                   f"[sgrt] {len(self.turns)} answers ({stopped} stopped), {len(self.messages())} messages in the "
                   f"conversation, {sum(t.completion_tokens for t in self.turns)} tokens generated")

    # ---- output --------------------------------------------------------------------------------
    def _note(self, text: str) -> None:
        print(text, file=self.stderr, flush=True)

    def _error(self, text: str) -> None:
        print(f"sgrt: error: {text}", file=self.stderr, flush=True)


def _isatty(stream: Any) -> bool:
    return bool(getattr(stream, "isatty", lambda: False)())


def _open_block(text: str) -> bool:
    """Whether ``text`` opens a ``\"\"\"`` block that no line has closed yet."""
    head = text.lstrip()
    return head.startswith(BLOCK) and not (len(head.rstrip()) >= 2 * len(BLOCK) and head.rstrip().endswith(BLOCK))


def _prompt_session() -> Any:
    """A prompt_toolkit session whose Enter sends the message, except inside an open
    ``\"\"\"`` block, where it starts a new line (shown after :data:`CONTINUATION`)."""
    from prompt_toolkit import PromptSession
    from prompt_toolkit.key_binding import KeyBindings

    keys = KeyBindings()

    # (c-j: an Enter typed while an answer streamed reaches the prompt as a line feed)
    @keys.add("enter")
    @keys.add("c-j")
    def _enter(event: Any) -> None:
        buffer = event.current_buffer
        if _open_block(buffer.text):
            buffer.insert_text("\n")
        else:
            buffer.validate_and_handle()

    # NOTE: multiline so that a paste's newlines and a block's lines show as lines; Enter is ours.
    return PromptSession(multiline=True, key_bindings=keys, prompt_continuation=CONTINUATION,
                         enable_open_in_editor=False)


def _flat(exc: BaseException) -> str:
    """An exception's message on one line (:func:`sgrt.errors.one_line`)."""
    return one_line(exc)
