"""``sgrt serve`` as a process: bad arguments and a port in use are reported before the model
loads, as one ``sgrt: error: ...`` line and a non-zero status; every server-limit flag has help
text with its default and reaches the limits."""
from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sgrt.cli", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=300)


@pytest.fixture
def busy_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    yield s.getsockname()[1]
    s.close()


def run_in_process(*args: str, capsys, monkeypatch) -> tuple[int, str]:
    """``sgrt.cli.main(args)`` here, with any model load failing the test: (status, stderr)."""
    import sgrt.engine
    from sgrt.cli import main

    def no_load(*a, **k):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(sgrt.engine, "Engine", no_load)
    capsys.readouterr()
    try:
        status = main(list(args))
    except SystemExit as exc:  # argparse's own errors
        status = exc.code
    return status, capsys.readouterr().err


# NOTE: one case of each kind runs as a process (its exit status and stderr are what a user
# sees); the others run through the same main() in this process (each process start costs an
# import of torch, several seconds on a loaded 2-core machine).
@pytest.mark.parametrize("which", ["--port", "--http-port"])
def test_a_port_in_use_is_one_error_line_before_the_model_loads(busy_port, which, capsys, monkeypatch):
    other = "--http-port" if which == "--port" else "--port"
    # NOTE: the other port is 0 (the OS picks a free one when it binds): a port probed free
    # beforehand could be taken by another process before sgrt binds it.
    args = ("serve", which, str(busy_port), other, "0", "--model", "no-such-model")
    if which == "--port":
        proc = run_cli(*args)
        status, stderr = proc.returncode, proc.stderr
    else:
        status, stderr = run_in_process(*args, capsys=capsys, monkeypatch=monkeypatch)
    assert status == 1, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("sgrt: error: "), stderr
    assert f"127.0.0.1:{busy_port}" in lines[0] and "in use" in lines[0]
    # NOTE: the model name does not exist: had it been loaded first, the error would name it.
    assert "no-such-model" not in stderr and "Traceback" not in stderr


@pytest.mark.parametrize("args, needle", [
    (["--port", "70000"], "--port"),
    (["--max-json-depth", "0"], "--max-json-depth"),
    (["--header-timeout", "nan"], "--header-timeout"),
    (["--programs", "/no/such/folder"], "--programs"),
])
def test_bad_serve_arguments_fail_before_loading(args, needle, capsys, monkeypatch):
    if needle == "--port":
        proc = run_cli("serve", "--model", "no-such-model", *args)
        status, stderr = proc.returncode, proc.stderr
    else:
        status, stderr = run_in_process("serve", "--model", "no-such-model", *args, capsys=capsys,
                                        monkeypatch=monkeypatch)
    assert status == 2, stderr
    assert needle in stderr and "Traceback" not in stderr and "no-such-model" not in stderr


def test_limit_flags_have_help_with_defaults_and_reach_the_limits():
    import argparse

    from sgrt.server.limits import HttpLimits, WsLimits
    from sgrt.server.serve import add_limit_args, limits_from_args

    parser = argparse.ArgumentParser()
    add_limit_args(parser)
    for action in parser._actions:
        if action.option_strings and action.dest != "help":
            assert action.help and "default" in action.help, action.option_strings
    http, ws = limits_from_args(parser.parse_args([]))
    assert http == HttpLimits() and ws == WsLimits()
    http, ws = limits_from_args(parser.parse_args([
        "--default-max-tokens", "64", "--max-json-depth", "10", "--header-timeout", "2", "--max-connections", "5",
        "--allowed-origin", "https://a.example", "--allowed-origin", "https://b.example", "--body-timeout", "3"]))
    assert http.default_max_tokens == 64 and http.max_json_depth == ws.max_json_depth == 10
    assert http.header_timeout_s == ws.open_timeout_s == 2.0 and http.body_timeout_s == 3.0
    assert http.max_connections == ws.max_connections == 5
    assert http.allowed_origins == ws.allowed_origins == ("https://a.example", "https://b.example")
