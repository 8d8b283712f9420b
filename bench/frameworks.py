"""Agent frameworks against a live ``sgrt serve``: a framework x feature pass / fail table.

Each framework of ``examples/frameworks/`` gets its own virtualenv under the cache directory
(``--cache-dir``, default ``$SGRT_CACHE_DIR/frameworks`` or ``~/.cache/sgrt/frameworks``),
because their pins conflict when installed together; a venv is made and filled with pip once
and reused (``--reinstall`` makes it again). The script starts ``sgrt serve`` on free loopback
ports (or uses ``--base-url``), runs each example with its venv's Python, reads the
``RESULT {...}`` lines the examples print, and prints the table, the errors, and one line of
JSON. Not part of CI: it installs packages from PyPI.

The baseline is the official ``openai`` / ``anthropic`` SDKs' behaviour the server is written
against: a feature passes when the framework, unchanged, gets a valid result through it.

Run: ``python bench/frameworks.py [--frameworks openai-agents,instructor] [--model NAME]``
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples" / "frameworks"

#: framework -> (pip requirements, example script). Pinned to the releases the README's table
#: was measured with (their own dependencies are resolved by pip at install time).
FRAMEWORKS = {
    "openai-agents": (["openai-agents==0.24.0"], "openai_agents_example.py"),
    "pydantic-ai": (["pydantic-ai-slim[openai]==2.68.0"], "pydantic_ai_example.py"),
    "instructor": (["instructor==1.17.0"], "instructor_example.py"),
    "langchain-openai": (["langchain-openai==1.7.4"], "langchain_example.py"),
    "anthropic": (["anthropic==2.15.0"], "anthropic_example.py"),
}


def cache_dir(arg: str | None) -> Path:
    if arg:
        return Path(arg).expanduser()
    root = os.environ.get("SGRT_CACHE_DIR") or "~/.cache/sgrt"
    return Path(root).expanduser() / "frameworks"


def ensure_venv(path: Path, requirements: list[str], reinstall: bool, timeout: float) -> Path:
    """The venv's Python, the venv made and ``requirements`` installed unless already done."""
    python = path / "bin" / "python"
    marker = path / ".sgrt-installed"
    wanted = json.dumps(sorted(requirements))
    if not reinstall and marker.exists() and marker.read_text() == wanted:
        return python
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(path)], check=True)
    # NOTE: at a low CPU priority: installs resolve and unpack for minutes on a shared machine.
    subprocess.run([str(python), "-m", "pip", "install", "-q", *requirements], check=True, timeout=timeout,
                   preexec_fn=(lambda: os.nice(10)) if hasattr(os, "nice") else None)
    marker.write_text(wanted)
    return python


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str, timeout: float) -> tuple[subprocess.Popen, str]:
    http_port, ws_port = free_port(), free_port()
    proc = subprocess.Popen([sys.executable, "-m", "sgrt.cli", "serve", "--model", model, "--port", str(ws_port),
                             "--http-port", str(http_port)], cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{http_port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"sgrt serve exited: {proc.stderr.read()[-2000:]}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return proc, url
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"sgrt serve did not answer /health within {timeout} s")


def run_example(python: Path, script: str, base_url: str, model: str, timeout: float) -> list[dict]:
    env = {**os.environ, "SGRT_BASE_URL": base_url + "/v1", "SGRT_MODEL": model}
    try:
        proc = subprocess.run([str(python), str(EXAMPLES / script)], cwd=EXAMPLES, env=env, capture_output=True,
                              text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return [{"feature": "(run)", "ok": False, "error": f"timed out after {timeout} s"}]
    results = [json.loads(line[7:]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if not results:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        results = [{"feature": "(run)", "ok": False, "error": f"exit {proc.returncode}: {tail[0][:300]}"}]
    return results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--frameworks", default=",".join(FRAMEWORKS), help="comma-separated (default: all)")
    ap.add_argument("--cache-dir", default=None)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--base-url", default=None, help="a running server (default: start sgrt serve)")
    ap.add_argument("--reinstall", action="store_true")
    ap.add_argument("--current-env", default="",
                    help="comma-separated frameworks to run with this Python instead of a venv (already installed)")
    ap.add_argument("--install-timeout", type=float, default=1800)
    ap.add_argument("--run-timeout", type=float, default=600)
    ap.add_argument("--start-timeout", type=float, default=900, help="seconds for sgrt serve to answer /health")
    args = ap.parse_args()
    names = [n.strip() for n in args.frameworks.split(",") if n.strip()]
    unknown = [n for n in names if n not in FRAMEWORKS]
    if unknown:
        ap.error(f"unknown frameworks {unknown}; known: {list(FRAMEWORKS)}")
    root = cache_dir(args.cache_dir)
    root.mkdir(parents=True, exist_ok=True)
    table: dict[str, list[dict]] = {}
    pythons = {}
    current = {n.strip() for n in args.current_env.split(",") if n.strip()}
    for name in names:
        reqs, _ = FRAMEWORKS[name]
        if name in current:
            pythons[name] = Path(sys.executable)
            continue
        try:
            pythons[name] = ensure_venv(root / name, reqs, args.reinstall, args.install_timeout)
        except (subprocess.SubprocessError, OSError) as e:
            table[name] = [{"feature": "(install)", "ok": False, "error": str(e)[:300]}]
    server = None
    base_url = args.base_url
    if base_url is None:
        server, base_url = start_server(args.model, timeout=args.start_timeout)
    try:
        for name, python in pythons.items():
            t0 = time.monotonic()
            table[name] = run_example(python, FRAMEWORKS[name][1], base_url.rstrip("/").removesuffix("/v1"),
                                      args.model, args.run_timeout)
            print(f"{name}: {sum(r['ok'] for r in table[name])}/{len(table[name])} in {time.monotonic() - t0:.0f} s",
                  file=sys.stderr, flush=True)
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=30)
    width = max(len(n) for n in table) if table else 10
    print(f"{'framework':<{width}}  feature results")
    errors = []
    for name, rows in table.items():
        cells = ", ".join(f"{r['feature']}: {'pass' if r['ok'] else 'FAIL'}" for r in rows)
        print(f"{name:<{width}}  {cells}")
        errors += [f"  {name} / {r['feature']}: {r['error']}" for r in rows if not r["ok"]]
    if errors:
        print("errors:")
        print("\n".join(errors))
    passed = sum(r["ok"] for rows in table.values() for r in rows)
    total = sum(len(rows) for rows in table.values())
    print(json.dumps({"bench": "frameworks", "model": args.model, "passed": passed, "total": total,
                      "results": {n: {r["feature"]: r["ok"] for r in rows} for n, rows in table.items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
