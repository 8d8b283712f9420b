"""The ``sgrt`` command line (issue 15: the CLI as a newcomer meets it; issue 41: as ollama and
llama.cpp users expect it). ``sgrt chat`` in a pseudo-terminal: tests/test_cli_chat.py."""
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


def run_cli(*args: str, timeout: float = 600, input: str | None = None,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sgrt.cli", *args], capture_output=True, text=True,
                          cwd=ROOT, env={**ENV, **(env or {})}, timeout=timeout, input=input)


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
            help_text = formatter._get_help_string(action)
            assert "%(default)s" in help_text or "(default: " in help_text, (name, action.option_strings)
        assert not re.search(r"\(default: [^()]*\) \(default: ", " ".join(sub.format_help().split())), name
        if name == "models":
            continue  # lists files: no engine options
        text = " ".join(sub.format_help().split())
        assert ("the context window: KV pool size in tokens (all requests' prompt + output at once); unset: from "
                "memory, 4 GiB of K/V or a quarter of the memory available, whichever is less (default: None; "
                "$SGRT_CTX_SIZE)") in text
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
    (["--regex", "[0-9"], "regex parse error: [0-9; error: unclosed character class"),
    (["--json-schema", "/no/such/schema.json"], "--json-schema '/no/such/schema.json' is neither JSON nor an existing file"),
    (["--json-schema", "@/no/such.json"], "no such file '/no/such.json'"),
    (["--grammar", "@/no/such.lark"], "no such file '/no/such.lark'"),
    (["--chat-template", "nope"], "--chat-template 'nope' is neither a template name (chatml, gemma, llama3, phi3)"),
    (["--top-k", "0"], "top_k must be -1 (disabled) or >= 1, got 0"),
    (["--min-p", "2"], "min_p must be in [0, 1], got 2"),
    (["--repeat-penalty", "0"], "repetition_penalty must be > 0, got 0"),
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


def test_a_bad_kv_cache_dtype_is_one_line_naming_the_flag(capsys):
    with pytest.raises(SystemExit) as info:
        main(["generate", "hello", "--kv-cache-dtype", "fp8"])
    assert info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "argument --kv-cache-dtype: invalid choice: 'fp8'" in lines[0]


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


# ---- issue 41 --------------------------------------------------------------------------------------

HEAVY = ("torch", "transformers")

# Runs sgrt.cli.main on each argument list in turn (environment per call), reporting after each its
# status, stderr and which heavy modules are imported by then.
_CHILD = """
import io, json, os, sys
from sgrt.cli import main
for env, argv in json.loads(sys.argv[1]):
    os.environ.update(env)
    err, sys.stderr = sys.stderr, io.StringIO()
    try:
        status = main(argv)
    except SystemExit as e:
        status = e.code
    text, sys.stderr = sys.stderr.getvalue(), err
    for k in env:
        del os.environ[k]
    print(json.dumps({"argv": argv, "status": status, "stderr": text,
                      "heavy": [m for m in %r if m in sys.modules]}), flush=True)
""" % (HEAVY,)


def _run_in_child(calls: list[tuple[dict, list[str]]]) -> list[dict]:
    proc = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(calls)], capture_output=True, text=True,
                          cwd=ROOT, env=ENV, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith('{"argv"')]


def test_help_version_and_argument_errors_start_without_torch():
    """Fast start: --help, --version, argument errors (argparse's, value checks, constraint
    checks, bad environment values) and a chat refused for want of a chat template all answer
    before torch or transformers is imported. (Timings: bench/cli_startup.py.)"""
    calls = [
        ({}, ["--version"]),
        ({}, ["--help"]),
        ({}, ["generate", "--help"]),
        ({}, ["chat", "--help"]),
        ({}, ["serve", "--help"]),
        ({}, ["generate", "hi", "--max-tokens", "many"]),
        ({}, ["generate", "hi", "--temperature", "-1"]),
        ({}, ["generate", "hi", "--regex", "[0-9"]),
        ({}, ["generate", "hi", "--json-schema", '{"type": "strnig"}']),
        ({"SGRT_DTYPE": "float64"}, ["generate", "hi"]),
        ({"SGRT_DTYPE": "float64"}, ["generate", "hi", "--dtype", "float32", "--top-p", "0"]),
        ({}, ["chat", "--model", "gemma3-270m-q4-k-m"]),
    ]
    out = _run_in_child(calls)
    assert [o["argv"] for o in out] == [argv for _, argv in calls]
    for o in out:
        assert o["heavy"] == [], o
    status = [o["status"] for o in out]
    assert status == [0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2], out
    err = [o["stderr"].strip() for o in out]
    assert all(len(e.splitlines()) == 1 and e.startswith("sgrt: error: ") for e in err[5:]), err
    assert "$SGRT_DTYPE='float64' is not a valid --dtype (choose from auto, float32, bfloat16)" in err[9]
    assert "top_p" in err[10] and "SGRT_DTYPE" not in err[10]  # the flag wins over the variable
    assert "has no chat template" in err[11] and "--chat-template gemma" in err[11]


def test_a_mistyped_flag_is_named_alone():
    """Not argparse's "unrecognized arguments: --temprature What is it?" (the prompt too)."""
    out = run_cli("generate", "--temprature", "0.5", "What is it?")
    assert out.returncode == 2
    assert out.stderr.strip() == ("sgrt: error: unknown flag --temprature (did you mean --temperature?) "
                                  "(see sgrt generate --help)")
    out = run_cli("generate", "hello", "world")
    assert out.returncode == 2 and "unexpected argument 'world'" in out.stderr and "hello" not in out.stderr


def test_generate_reads_the_prompt_from_stdin():
    """No TEXT, or TEXT '-': the prompt is stdin (a pipe), in the chat template as TEXT is."""
    question = "What is the capital of France?\n"
    for args in (["generate"], ["generate", "-"]):
        out = run_cli(*args, "--json", "--max-tokens", "12", "--quiet", input=question)
        assert out.returncode == 0, out.stderr[-3000:]
        report = json.loads(out.stdout)
        assert "Paris" in report["text"]
        assert report["tokens"]["prompt"] > 20  # the question in the chat template, not alone
    out = run_cli("generate", "--quiet", input="")
    assert out.returncode == 2 and "stdin was empty" in out.stderr


def test_json_output_sampling_flags_and_the_load_line():
    """--json: one object with the text, how it ended, tokens and timings; the sampling flags
    as the engine ran them; --quantization int4 alone loads bfloat16, and the load line names
    dtype, quantization, KV pool (--ctx-size, --kv-cache-dtype) and threads (--threads)."""
    out = run_cli("generate", "--json", "-n", "16", "--top-k", "5", "--min-p", "0.05", "--repeat-penalty", "1.1",
                  "--stop", ".", "--stop", "!", "-s", "3", "-t", "1", "-c", "2048", "--quantization", "int4",
                  "--kv-cache-dtype", "int8", "What is the capital of France?")
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout)
    assert report["sampling"]["top_k"] == 5 and report["sampling"]["min_p"] == 0.05
    assert report["sampling"]["repetition_penalty"] == 1.1 and report["sampling"]["seed"] == 3
    assert report["sampling"]["stop"] == [".", "!"] and report["sampling"]["max_tokens"] == 16
    assert "Paris" in report["text"] and "." not in report["text"]  # stopped at ".", not printed
    assert report["finish_reason"] == "stop" and report["matched"] == "."
    assert report["tokens"]["completion"] == len(report["tokens"]["ids"]) > 0
    assert report["timings"]["load_s"] > 0 and report["timings"]["total_s"] >= report["timings"]["ttft_s"] > 0
    load = next(line for line in out.stderr.splitlines() if line.startswith("[sgrt] loaded"))
    assert "bfloat16, quantization int4" in load and "KV pool 2048 tokens" in load and "; 1 threads" in load
    assert "int8 (+ float32 scales) K/V, 12240 bytes a token" in load


def test_a_cut_constrained_answer_warns_and_exits_3(tmp_path):
    """--json-schema from @file, cut by --max-tokens: the partial JSON on stdout, a warning on
    stderr, status 3; the same schema as a plain path with room enough: valid JSON, status 0."""
    schema = tmp_path / "person.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                                                  "age": {"type": "integer"}},
                                  "required": ["name", "age"], "additionalProperties": False}))
    out = run_cli("generate", "--json-schema", f"@{schema}", "-n", "4", "Invent a person.")
    assert out.returncode == 3, out.stderr[-3000:]
    with pytest.raises(ValueError):
        json.loads(out.stdout)
    assert "sgrt: warning: the answer was cut at --max-tokens 4 before its --json-schema constraint was complete" \
        in out.stderr
    out = run_cli("generate", "--json-schema", str(schema), "-n", "64", "--quiet", "Invent a person.")
    assert out.returncode == 0, out.stderr[-3000:]
    value = json.loads(out.stdout)
    assert set(value) == {"name", "age"} and isinstance(value["age"], int)


def test_model_from_the_environment():
    """$SGRT_MODEL is the default --model: a name that does not exist fails the load naming it."""
    out = run_cli("generate", "hi", env={"SGRT_MODEL": "no-such-model-41"})
    assert out.returncode == 1
    assert out.stderr.strip().splitlines()[-1].startswith("sgrt: error: model 'no-such-model-41' not found")


def test_readme_documents_the_command_line():
    """The README's CLI section names every flag of generate / chat / models (the grammar limits
    as a family) and each issue-41 item: chat keys and commands, exit statuses, variables."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    start = readme.index("### The command line")
    section = readme[start:readme.index("\n## ", start)]
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for name in ("generate", "chat", "models"):
        for action in sub.choices[name]._actions:
            if action.help == argparse.SUPPRESS or action.dest == "help" or action.dest.startswith("limit_llguidance"):
                continue
            longest = max(action.option_strings, key=len, default=None)
            if longest is not None:
                assert any(flag in section for flag in action.option_strings), (name, longest)
    for item in ('"""', "Ctrl-C", "Ctrl-D", "/help", "/clear", "/system TEXT", "/set temperature", "/stats",
                 "/bye", "| 3 |", "| 130 |", "SGRT_MODEL", "SGRT_THREADS", "SGRT_CTX_SIZE", "`incomplete`",
                 "--chat-template NAME"):
        assert item in section, item
    assert "--served-model-name" in readme and "model_not_found" in readme
