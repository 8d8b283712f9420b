"""The ``sgrt`` command line."""
from __future__ import annotations

import subprocess
import sys

from sgrt.cli import build_parser, main


def test_help_lists_the_commands():
    out = subprocess.run([sys.executable, "-m", "sgrt.cli", "--help"], capture_output=True, text=True, check=True)
    for command in ("generate", "chat", "serve"):
        assert command in out.stdout


def test_generate_streams_an_answer_with_metrics(capsys):
    assert main(["generate", "--chat", "What is the capital of France?", "--max-tokens", "16"]) == 0
    captured = capsys.readouterr()
    assert "Paris" in captured.out
    assert "TTFT" in captured.err and "tok/s" in captured.err


def test_bad_value_is_a_clear_error(capsys):
    assert main(["generate", "hello", "--temperature", "-1"]) == 1
    assert "temperature" in capsys.readouterr().err


def test_parser_defaults_are_greedy():
    args = build_parser().parse_args(["generate", "x"])
    assert args.temperature == 0.0 and args.model == "smollm2-135m-instruct"
    assert args.quantization == "none"
    assert build_parser().parse_args(["chat", "--quantization", "int4"]).quantization == "int4"
