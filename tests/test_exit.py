"""A script that uses sgrt.Runtime() exits with its own status, never SIGABRT (issue 15).

The engine's loop thread is a daemon; killed at interpreter finalization inside a torch op, it
aborted the process ("terminate called without an active exception", status 134). Each script
here leaves the engine busy (requests still decoding) when it exits, the case that aborted.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = """
import sys, time
import sgrt
rt = sgrt.Runtime(max_total_tokens=2048)
sgrt.set_default_backend(rt)

@sgrt.function
def hello(s):
    s += "The capital of France is"
    s += sgrt.gen("city", max_tokens=3)

print("gen:", repr(hello.run()["city"]), flush=True)
# Leave the engine busy: requests still decoding at exit.
for i in range(4):
    rt.engine.submit(f"Tell a long story number {{i}}.", {{"max_tokens": 400, "ignore_eos": True}})
time.sleep(2.0)
{ending}
"""


# A clean exit (status 0) is tests/test_cli.py::test_generate_process_exits_0.
@pytest.mark.parametrize("ending, status", [
    ("raise SystemExit(3)", 3),
    ("raise RuntimeError('a bug in the user script')", 1),
])
def test_script_exits_with_its_own_status(ending, status, tmp_path):
    script = tmp_path / "user_script.py"
    script.write_text(SCRIPT.format(ending=ending))
    proc = subprocess.run([sys.executable, str(script)], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == status, f"rc {proc.returncode}\n{proc.stderr[-3000:]}"
    assert "gen: '" in proc.stdout
    assert "terminate called" not in proc.stderr
    if status == 1:
        assert "RuntimeError: a bug in the user script" in proc.stderr
