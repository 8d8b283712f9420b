"""Serving speed as users see it: the same workloads through the OpenAI API of sgrt, llama.cpp's
server and vLLM's CPU build, each engine its own process on the same machine (issue 39).

Workloads (greedy, ``ignore_eos`` so every engine generates the same number of tokens):

1. **batch-1**: ``--single`` streamed ``/v1/completions`` one at a time, ``--tokens`` each: decode
   tok/s (after the first token, client side) and TTFT; beside it sgrt's in-process engine on the
   same requests (the HTTP path's cost: target >= 0.9x), ``--rounds`` times alternated with the
   server's runs, medians (this machine's speed drifts by up to ~25% between minutes and
   processes, so one run of each side does not compare).
2. **c16**: 64 streamed chat requests, 16 in flight, ``--tokens`` each: output tok/s.
3. **agent**: 8 concurrent sessions x 6 turns of one growing conversation each: a ~700-token
   system prompt of tool descriptions (the same for every session), a user task, then per turn a
   48-token reply and a ~200-token tool result appended; streamed chat. Later-turn (2-6) TTFT
   p50 / p95 and wall time.

Engines: ``sgrt`` (``sgrt serve``, ``--sgrt-args``: default int4, bfloat16 activations, the
default KV pool), ``llamacpp`` (``bench/llamacpp_server.py``, the xllamacpp wheel, on the default
model's GGUF, ``--parallel 16``, 2 threads, context ``--llamacpp-ctx``), ``vllm`` (``--vllm-venv``'s
``vllm.entrypoints.openai.api_server`` on the default model exported as an HF folder, bfloat16,
4 GB of KV space: docs/SCALING.md has its install). Engines run one after another, the
machine otherwise quiet; say the load.

Run: ``python bench/serving.py [--engines sgrt,llamacpp,vllm] [--workloads batch1,c16,agent]``; ``--model
gemma3-270m-q4-k-m`` (sgrt alone) measures the other packaged model, whose GGUF carries no chat
template: its chat workloads need ``--sgrt-args "... --chat-template gemma"``.
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import emit_json, percentile, print_table  # noqa: E402
from bench.workloads import filler  # noqa: E402

MODEL = "smollm2-135m-instruct"
TOOLS_PROMPT = ("You are an agent with these tools. Call one by writing its name and JSON arguments.\n"
                + "\n".join(f"- tool_{i}(query: string, limit: integer): " + filler(random.Random(i), 22)
                            for i in range(18)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ==== engines =====================================================================================

def start(engine: str, args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    """Start ``engine`` serving the default model; (process, base URL) once it answers."""
    port = free_port()
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONPATH=str(ROOT))
    if engine == "sgrt":
        cmd = [sys.executable, "-m", "sgrt.cli", "serve", "--port", str(free_port()), "--http-port", str(port),
               "--quiet", "--model", args.model, *args.sgrt_args.split()]
    elif args.model != MODEL:
        raise SystemExit(f"--model {args.model}: only sgrt runs another model than {MODEL}")
    elif engine == "llamacpp":
        from sgrt.models.loader import default_gguf_path

        cmd = [sys.executable, str(ROOT / "bench" / "llamacpp_server.py"), "--model", str(default_gguf_path()),
               "--port", str(port), "--alias", MODEL, "--parallel", "16", "--threads", str(args.threads),
               "--ctx", str(args.llamacpp_ctx)]
    elif engine == "vllm":
        from types import SimpleNamespace

        from bench.common import hf_folder
        from sgrt.models.loader import default_gguf_path

        folder = hf_folder(SimpleNamespace(source=f"gguf:{default_gguf_path()}"))
        py = Path(args.vllm_venv) / "bin" / "python"
        cmd = [str(py), "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder),
               "--served-model-name", MODEL, "--host", "127.0.0.1", "--port", str(port), "--dtype", "bfloat16",
               "--max-model-len", "8192", "--disable-log-stats"]
        env.update(VLLM_TARGET_DEVICE="cpu", VLLM_CPU_KVCACHE_SPACE="4", VLLM_CPU_OMP_THREADS_BIND="nobind",
                   VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
        env.pop("PYTHONPATH")
    else:
        raise SystemExit(f"unknown engine {engine!r}")
    log = open(f"/tmp/serving-{engine}.log", "w")
    # (in the root: ``python -m`` puts the working folder first on the path, before PYTHONPATH)
    proc = subprocess.Popen(cmd, stdout=log, stderr=log, env=env, start_new_session=True, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 900
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{engine} exited ({proc.returncode}): see /tmp/serving-{engine}.log")
        try:
            urllib.request.urlopen(url + "/v1/models", timeout=2).read()
            return proc, url
        except OSError:
            time.sleep(1)
    stop(proc)
    raise RuntimeError(f"{engine} did not answer within 900 s")


def stop(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        os.killpg(proc.pid, signal.SIGKILL)


# ==== one streamed request ========================================================================

def stream(url: str, local: threading.local, path: str, body: dict) -> dict:
    """POST a streamed request on this thread's keep-alive connection: TTFT (first content), decode
    tok/s after it, the completion's tokens and text."""
    host, port = url.split("://", 1)[1].rsplit(":", 1)
    conn = getattr(local, "conn", None)
    if conn is None:
        conn = local.conn = http.client.HTTPConnection(host, int(port), timeout=900)
    body = {"model": MODEL, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}, **body}  # (greedy, fixed lengths, usage at the end)
    t0 = time.perf_counter()
    try:
        conn.request("POST", path, body=json.dumps(body), headers={"content-type": "application/json"})
        resp = conn.getresponse()
    except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
        # llama.cpp's server closes a keep-alive connection after a streamed response without saying
        # so; like a pooled client (httpx, the openai SDK), open a new connection and send it again.
        conn.close()
        conn = local.conn = http.client.HTTPConnection(host, int(port), timeout=900)
        t0 = time.perf_counter()
        conn.request("POST", path, body=json.dumps(body), headers={"content-type": "application/json"})
        resp = conn.getresponse()
    if resp.status != 200:
        return {"error": f"HTTP {resp.status}: {resp.read()[:300]!r}"}
    ttft, last, tokens, chunks, text = None, None, 0, 0, []
    while True:
        line = resp.readline()
        if not line:
            break
        if not line.startswith(b"data: "):
            continue
        data = line[6:].strip()
        if data == b"[DONE]":
            break
        event = json.loads(data)
        for choice in event.get("choices") or []:
            piece = choice.get("text") if "text" in choice else (choice.get("delta") or {}).get("content")
            if piece:
                now = time.perf_counter()
                ttft = now - t0 if ttft is None else ttft
                last, chunks = now, chunks + 1
                text.append(piece)
        if event.get("usage"):
            tokens = event["usage"]["completion_tokens"]
    resp.read()
    tokens = tokens or chunks
    decode = (tokens - 1) / (last - t0 - ttft) if ttft is not None and last and tokens > 1 and last > t0 + ttft else 0.0
    return {"ttft": ttft, "tokens": tokens, "decode": decode, "text": "".join(text),
            "latency": time.perf_counter() - t0}


# ==== workloads ===================================================================================

def batch1(url: str, args: argparse.Namespace) -> dict:
    local = threading.local()
    prompts = [f"Story {i}: " + filler(random.Random(i), 60) for i in range(args.single + 1)]
    stream(url, local, "/v1/completions", {"model": args.model, "prompt": prompts[0], "max_tokens": 8})  # warm
    runs = [stream(url, local, "/v1/completions", {"model": args.model, "prompt": p, "max_tokens": args.tokens})
            for p in prompts[1:]]
    errors = [r["error"] for r in runs if "error" in r]
    ok = [r for r in runs if "error" not in r]
    return {"decode": statistics.median(r["decode"] for r in ok) if ok else 0.0,
            "ttft_p50": statistics.median(r["ttft"] for r in ok) if ok else 0.0, "errors": len(errors)}


def c16(url: str, args: argparse.Namespace) -> dict:
    local = threading.local()
    work = [[{"role": "user", "content": f"Request {i}. " + filler(random.Random(100 + i), 40)
              + "\nSummarise the text above."}] for i in range(64)]
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda m: stream(url, local, "/v1/chat/completions",
                                       {"model": args.model, "messages": m, "max_tokens": 4}), work[:16]))
        t0 = time.perf_counter()
        runs = list(pool.map(lambda m: stream(url, local, "/v1/chat/completions",
                                              {"model": args.model, "messages": m, "max_tokens": args.tokens}),
                             work))
        wall = time.perf_counter() - t0
    ok = [r for r in runs if "error" not in r]
    return {"throughput": sum(r["tokens"] for r in ok) / wall, "errors": len(runs) - len(ok)}


def agent(url: str, args: argparse.Namespace, sessions: int = 8, turns: int = 6) -> dict:
    """8 sessions x 6 turns over growing conversations (module docstring)."""
    local = threading.local()

    def session(k: int) -> list[dict]:
        rng = random.Random(1000 + k)
        messages = [{"role": "system", "content": TOOLS_PROMPT},
                    {"role": "user", "content": f"Task {k}: find what the notes say about " + filler(rng, 12)}]
        out = []
        for turn in range(turns):
            r = stream(url, local, "/v1/chat/completions",
                       {"model": args.model, "messages": messages, "max_tokens": 48})
            r["turn"] = turn
            out.append(r)
            messages.append({"role": "assistant", "content": r.get("text") or "(no reply)"})
            messages.append({"role": "user", "content": "Tool result: " + filler(rng, 180)})
        return out

    t0 = time.perf_counter()
    with ThreadPoolExecutor(sessions) as pool:
        results = [r for rs in pool.map(session, range(sessions)) for r in rs]
    wall = time.perf_counter() - t0
    later = [r["ttft"] for r in results if r["turn"] > 0 and r.get("ttft") is not None]
    return {"wall": wall, "ttft_p50": percentile(later, 50), "ttft_p95": percentile(later, 95),
            "errors": sum("error" in r for r in results)}


def alternate_batch1(url: str, args: argparse.Namespace, sgrt: dict) -> dict:
    """``--rounds`` in-process batch-1 runs, each after another HTTP one (the first HTTP run is
    ``sgrt["batch1"]``, which becomes the median of all): ``{"batch1": {"decode": median}}``."""
    http, local = [sgrt["batch1"]], []
    for r in range(args.rounds):
        if r:
            http.append(batch1(url, args))
        local.append(in_process_batch1(args))
    sgrt["batch1"] = {"decode": statistics.median(h["decode"] for h in http),
                      "ttft_p50": statistics.median(h["ttft_p50"] for h in http),
                      "errors": sum(h["errors"] for h in http), "runs": [h["decode"] for h in http]}
    return {"batch1": {"decode": statistics.median(local), "runs": local}}


def in_process_batch1(args: argparse.Namespace) -> float:
    """sgrt's engine without HTTP on the batch-1 requests (same options as the server's default)."""
    code = (
        "import json, random, statistics, sys\n"
        f"sys.path.insert(0, {str(ROOT)!r})\n"
        "from bench.workloads import filler\n"
        "from sgrt.engine import Engine, SamplingParams\n"
        f"eng = Engine(model={args.model!r}, **{_engine_kwargs(args.sgrt_args)!r})\n"
        f"ps = [f'Story {{i}}: ' + filler(random.Random(i), 60) for i in range({args.single} + 1)]\n"
        "eng.generate(ps[0], SamplingParams(max_tokens=8))\n"
        "rates = []\n"
        "for p in ps[1:]:\n"
        f"    r = eng.generate(p, SamplingParams(max_tokens={args.tokens}, temperature=0, ignore_eos=True))\n"
        "    rates.append((r.completion_tokens - 1) / (r.total_time - r.ttft))\n"
        "print(json.dumps(statistics.median(rates)))\n"
        "eng.shutdown()\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-2000:])
    return float(out.stdout.strip().splitlines()[-1])


def _engine_kwargs(sgrt_args: str) -> dict:
    """``sgrt serve``'s model flags in ``--sgrt-args`` as Engine keywords."""
    words, out = sgrt_args.split(), {}
    names = {"--dtype": "dtype", "--quantization": "quantization", "--max-total-tokens": "max_total_tokens"}
    for flag, value in zip(words, words[1:]):
        if flag in names:
            out[names[flag]] = int(value) if flag == "--max-total-tokens" else value
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engines", default="sgrt,llamacpp")
    ap.add_argument("--workloads", default="batch1,c16,agent")
    ap.add_argument("--sgrt-args", default="--dtype bfloat16 --quantization int4")
    ap.add_argument("--model", default=MODEL, help="the model sgrt serves (the other engines: only the default)")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--single", type=int, default=5, help="batch-1 requests")
    ap.add_argument("--rounds", type=int, default=3,
                    help="batch-1 runs of sgrt's server and in-process engine, alternated")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--llamacpp-ctx", type=int, default=32768)
    ap.add_argument("--vllm-venv", default="/work/venvs/vllm")
    args = ap.parse_args()
    workloads = {"batch1": batch1, "c16": c16, "agent": agent}
    results: dict[str, dict] = {}
    for engine in args.engines.split(","):
        proc, url = start(engine, args)
        try:
            results[engine] = {w: workloads[w](url, args) for w in args.workloads.split(",")}
            if engine == "sgrt" and "batch1" in results[engine]:
                results["sgrt (in-process)"] = alternate_batch1(url, args, results[engine])
        finally:
            stop(proc)
        print(f"[bench] {engine}: {json.dumps(results[engine])}", file=sys.stderr)
    rows = []
    for engine, r in results.items():
        b, c, a = r.get("batch1", {}), r.get("c16", {}), r.get("agent", {})
        rows.append([engine, b.get("decode", 0.0), b.get("ttft_p50", 0.0), c.get("throughput", 0.0),
                     a.get("ttft_p50", 0.0), a.get("ttft_p95", 0.0), a.get("wall", 0.0),
                     sum(x.get("errors", 0) for x in r.values())])
    print(f"{args.model}, sgrt {args.sgrt_args!r}, {args.threads} threads, load {os.getloadavg()[0]:.2f}")
    print_table(["engine", "batch-1 tok/s", "TTFT s", "c16 tok/s", "agent TTFT p50 s", "p95 s", "agent wall s",
                 "errors"], rows)
    if "sgrt (in-process)" in results and results["sgrt"].get("batch1"):
        print(f"HTTP / in-process batch-1 decode: "
              f"{results['sgrt']['batch1']['decode'] / results['sgrt (in-process)']['batch1']['decode']:.2f}")
    emit_json("serving", results=results, load=os.getloadavg())


if __name__ == "__main__":
    main()
