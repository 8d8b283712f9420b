"""The ``sgrt`` command line (issue 15: the CLI as a newcomer meets it)."""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from sgrt.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def run_cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sgrt.cli", *args], capture_output=True, text=True,
                          cwd=ROOT, env=ENV, timeout=timeout)


def test_help_lists_the_commands():
    out = run_cli("--help")
    assert out.returncode == 0
    for command in ("generate", "chat", "serve"):
        assert command in out.stdout


def test_version():
    from sgrt import __version__

    out = run_cli("--version")
    assert out.returncode == 0 and out.stdout.strip() == f"sgrt {__version__}"


def test_every_flag_has_help_with_its_default():
    parser = build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, sub in subparsers.choices.items():
        formatter = sub._get_formatter()
        for action in sub._actions:
            if not action.option_strings or action.help == argparse.SUPPRESS or action.dest == "help":
                continue
            assert action.help, f"sgrt {name} {action.option_strings[0]} has no help"
            if action.dest == "auth_token":
                continue  # its default is a secret: see test_help_never_prints_the_auth_token
            assert "%(default)s" in formatter._get_help_string(action), (name, action.option_strings)
        if name == "models":
            continue  # lists files: no engine options
        text = " ".join(sub.format_help().split())
        assert ("KV pool size in tokens (all requests' prompt + output at once); unset: from memory, 4 GiB of K/V "
                "or a quarter of the memory available, whichever is less (default: None)") in text
        assert "--max-ref-depth N longest chain of $ref hops in a JSON Schema (default: 64)" in text


def test_generate_applies_the_chat_template_by_default(capsys):
    """An instruct model answers a question (raw completion of it ended at once: issue 15)."""
    assert main(["generate", "What is the capital of France?", "--max-tokens", "16"]) == 0
    captured = capsys.readouterr()
    assert "Paris" in captured.out
    assert "TTFT" in captured.err and "tok/s" in captured.err


def test_raw_is_a_plain_completion(runtime, capsys):
    prompt = "The capital of France is"
    expected = runtime.engine.generate(prompt, {"max_tokens": 6}).text
    assert main(["generate", "--raw", prompt, "--max-tokens", "6", "--quiet"]) == 0
    captured = capsys.readouterr()
    assert captured.out == expected + "\n"
    assert captured.err == ""  # --quiet: no load or timing lines


@pytest.mark.parametrize("args, names", [
    (["--json-schema", "{not json"], "json_schema is not valid JSON"),
    (["--json-schema", '{"type": "array", "items": {"$ref": "#"}, "minItems": 1}'], "no finite instance"),
    (["--json-schema", '{"type": "strnig"}'], "strnig"),
    (["--regex", "(a{1000}){1000}"], "max_repeat_product=2000"),
    (["--regex", "a("], "--regex is not a valid constraint"),
    (["--grammar", "no_such_grammar"], "no grammar file 'no_such_grammar'"),
    (["--temperature", "-1"], "temperature"),
    (["--max-total-tokens", "0"], "--max-total-tokens must be >= 1"),
    (["--max-ref-depth", "0"], "max_ref_depth must be an int >= 1"),
    (["--regex", "a", "--json-schema", "{}"], "at most one of"),
    (["--int4-activations", "int8"], "int4_activations='int8' applies to quantization='int4'"),
    (["--chat-template", "nope"], "--chat-template 'nope' is neither a template name (chatml, gemma, llama3, phi3)"),
])
def test_bad_arguments_fail_before_the_model_load(args, names, capsys, monkeypatch):
    import sgrt.engine

    def no_load(*a, **k):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(sgrt.engine, "Engine", no_load)
    assert main(["generate", "hello", *args]) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("sgrt: error: ") and names in lines[0], err


def test_argparse_errors_are_one_line():
    out = run_cli("generate", "hi", "--max-tokens", "many")
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("sgrt: error: ") and "--max-tokens" in lines[0]


def test_generate_process_exits_0_and_is_quiet_off_a_terminal():
    """A real ``sgrt generate`` process: status 0 (it aborted with 134 at exit), the answer on
    stdout, and no progress bar when stderr is not a terminal."""
    out = run_cli("generate", "What is the capital of France?", "--max-tokens", "8")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Paris" in out.stdout
    assert "terminate called" not in out.stderr and "loading" not in out.stderr  # no tqdm line


@pytest.mark.parametrize("flag,value,check", [
    ("--regex", "[0-9]{4}", lambda text: re.fullmatch(r"[0-9]{4}", text)),
    ("--json-schema", '{"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, '
     '"required": ["city"], "additionalProperties": false}', lambda text: isinstance(json.loads(text)["city"], str)),
    ("--grammar", 'start: "YES" | "NO"', lambda text: text in ("YES", "NO")),
])
def test_constrained_generate_process_exits_0_with_a_valid_answer(flag, value, check):
    """The README's constrained ``sgrt generate`` (reported: every valid constraint crashed after
    the model load, calling an engine method that had moved): status 0 and a valid answer."""
    out = run_cli("generate", flag, value, "--max-tokens", "24", "The year of the French Revolution, as asked:")
    assert out.returncode == 0, out.stderr[-3000:]
    assert check(out.stdout.strip()), out.stdout


def test_progress_lines_only_when_enabled(capsys):
    from sgrt.progress import progress, set_progress

    try:
        set_progress(True)
        with progress("converting model.gguf"):
            pass
        assert "[sgrt] converting model.gguf" in capsys.readouterr().err
        set_progress(False)
        with progress("converting model.gguf"):
            pass
        assert capsys.readouterr().err == ""
    finally:
        set_progress(None)


def test_parser_defaults_are_greedy():
    args = build_parser().parse_args(["generate", "x"])
    assert args.temperature == 0.0 and args.model == "smollm2-135m-instruct"
    assert args.quantization == "none" and args.raw is False
    assert build_parser().parse_args(["chat", "--quantization", "int4"]).quantization == "int4"


def test_help_never_prints_the_auth_token(monkeypatch):
    # --auth-token defaults to $SGRT_AUTH_TOKEN: the help names the variable, never its value.
    monkeypatch.setenv("SGRT_AUTH_TOKEN", "s3cret-token-value")
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    text = " ".join(sub.choices["serve"].format_help().split())
    assert "required first-message token (default: $SGRT_AUTH_TOKEN)" in text
    assert "s3cret-token-value" not in text
