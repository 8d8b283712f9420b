"""How long ``sgrt`` takes to answer what needs no model (issue 41): ``--version``, ``--help``,
an argument error, a constraint error, ``sgrt models``, a chat refused for want of a template.

Each command runs as a fresh process, alternating with the baselines, ``--runs`` rounds; the
figure is the median wall time. Baselines, run the same way: ``python -c pass`` (the
interpreter's own start) and ``python -c "import torch"`` (what every command cost before: the old
CLI imported torch for all of them). Targets from the issue: < 0.5 s for ``--help``, ``--version``
and argument errors, < 2 s for ``sgrt models`` (on the 2-core machine, whose load is shown).

Run: ``python bench/cli_startup.py [--runs 5]``
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import emit_json, interleaved_medians, print_table  # noqa: E402

PY = sys.executable
COMMANDS: dict[str, list[str]] = {
    "python -c pass": [PY, "-c", "pass"],
    "python -c 'import torch'": [PY, "-c", "import torch"],
    "sgrt --version": [PY, "-m", "sgrt.cli", "--version"],
    "sgrt --help": [PY, "-m", "sgrt.cli", "--help"],
    "sgrt generate --help": [PY, "-m", "sgrt.cli", "generate", "--help"],
    "sgrt generate hi --max-tokens many": [PY, "-m", "sgrt.cli", "generate", "hi", "--max-tokens", "many"],
    "sgrt generate hi --regex '[0-9'": [PY, "-m", "sgrt.cli", "generate", "hi", "--regex", "[0-9"],
    "sgrt chat -m gemma3-270m-q4-k-m": [PY, "-m", "sgrt.cli", "chat", "--model", "gemma3-270m-q4-k-m"],
    "sgrt models": [PY, "-m", "sgrt.cli", "models"],
}
TARGETS = {"sgrt models": 2.0}  # everything else without a model: 0.5 s


def _run(cmd: list[str]) -> float:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    load_before = os.getloadavg()[0]
    medians = interleaved_medians(COMMANDS, args.runs, _run)
    load_after = os.getloadavg()[0]
    base, torch_import = medians["python -c pass"], medians["python -c 'import torch'"]
    rows, table = {}, []
    for name, sec in medians.items():
        target = None if name.startswith("python") else TARGETS.get(name, 0.5)
        rows[name] = {"median_s": round(sec, 3), "vs_python_pass": round(sec / base, 2),
                      "vs_import_torch": round(sec / torch_import, 2), "target_s": target}
        table.append([name, sec, round(sec / base, 1), round(sec / torch_import, 2),
                      "" if target is None else f"< {target}"])
    print_table(["command", "median s", "x python -c pass", "x import torch", "target s"], table)
    print(f"load average (1 min): {load_before:.2f} before, {load_after:.2f} after; {args.runs} runs each")
    emit_json("cli_startup", runs=args.runs, load_before=load_before, load_after=load_after, commands=rows)


if __name__ == "__main__":
    main()
