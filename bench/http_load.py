"""HTTP API load: 64 streaming chat requests at concurrency 16, through HTTP vs in-process.

Workload: 64 chat prompts (a shared system prompt, a distinct ~60-token user message each),
greedy, 48 new tokens each with EOS ignored (so both runs generate exactly the same tokens),
float32, 2 torch threads. At most 16 requests in flight; a new one starts when one finishes.

- **HTTP**: ``POST /v1/chat/completions`` with ``stream: true`` to an sgrt server on loopback,
  by default in a child process (``--server process``; the client is this process: 16 threads
  with keep-alive ``http.client`` connections reading the SSE lines), or on a thread of this
  process (``--server thread``).
- **Baseline, same invocation**: the same prompts submitted straight to an in-process engine
  (``engine.submit`` + ``astream``), 16 at a time.

The two alternate for ``--rounds`` rounds (default 2, the order swapped each round; each engine
idles while the other runs, and both start each run with an empty prefix cache and a short
warm-up), so that load from other processes hits both alike. Reported per run and as medians: output tok/s and the ratio
HTTP / in-process (target >= 0.9), requests/s, TTFT p50 / p99 (from sending to the first
content token, client side), errors (target 0).

Run: ``python bench/http_load.py [--requests 64] [--concurrency 16] [--max-tokens 48]``
"""
from __future__ import annotations

import argparse
import asyncio
import http.client
import os
import random
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import emit_json, percentile, print_table  # noqa: E402
from bench.serving import stream  # noqa: E402
from bench.workloads import filler  # noqa: E402

MODEL = "smollm2-135m-instruct"
SYSTEM = "You are a concise assistant. Answer in plain prose."


def workload(n: int, seed: int = 0) -> list[list[dict[str, str]]]:
    rng = random.Random(seed)
    return [[{"role": "system", "content": SYSTEM},
             {"role": "user", "content": f"Request {i}. " + filler(rng, 40) + "\nSummarise the text above."}]
            for i in range(n)]


# ==== HTTP ========================================================================================


def http_one(url: str, local: threading.local, messages: list, max_tokens: int) -> dict:
    """One streaming chat request on this thread's keep-alive connection (``bench.serving.stream``)."""
    return stream(url, local, "/v1/chat/completions", {"messages": messages, "max_tokens": max_tokens})


def run_http(url: str, work: list, concurrency: int, max_tokens: int) -> tuple[float, list[dict]]:
    local = threading.local()
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(lambda m: http_one(url, local, m, 4), work[:concurrency]))  # warm-up + connections
        t0 = time.perf_counter()
        results = list(pool.map(lambda m: http_one(url, local, m, max_tokens), work))
        return time.perf_counter() - t0, results


def start_server_process(threads: int) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, __file__, "--serve", "--threads", str(threads)]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    line = proc.stdout.readline().strip()
    if not line.startswith("READY "):
        proc.kill()
        raise RuntimeError(f"the server process did not start: {line!r}")
    return proc, line.split(" ", 1)[1]


def serve_main(threads: int) -> None:
    """Child process: an engine and the HTTP API on a free loopback port until stdin closes."""
    import torch

    torch.set_num_threads(threads)
    from sgrt.engine import Engine
    from sgrt.server.http.server import serve_http

    engine = Engine(model=MODEL, max_total_tokens=16384)

    async def main() -> None:
        server = await serve_http(engine, "127.0.0.1", 0, model_name=MODEL)
        print(f"READY {server.url}", flush=True)
        await asyncio.to_thread(sys.stdin.read)  # until the parent closes our stdin
        await server.close()

    try:
        asyncio.run(main())
    finally:
        engine.shutdown()


# ==== in-process baseline =========================================================================


def run_inprocess(engine, work: list, concurrency: int, max_tokens: int) -> tuple[float, list[dict]]:
    from sgrt.engine import SamplingParams

    tok = engine.tokenizer

    async def one(messages: list, n: int) -> dict:
        ids = tok.encode(tok.apply_chat_template(messages))
        t0 = time.perf_counter()
        handle = engine.submit(ids, SamplingParams(max_tokens=n, ignore_eos=True))
        ttft = None
        result = None
        async for chunk in handle.astream():
            if chunk.text and ttft is None:
                ttft = time.perf_counter() - t0
            if chunk.finished:
                result = chunk.result
        return {"ttft": ttft, "tokens": result.completion_tokens, "latency": time.perf_counter() - t0}

    async def run_all(items: list, n: int) -> list[dict]:
        sem = asyncio.Semaphore(concurrency)

        async def limited(m: list) -> dict:
            async with sem:
                return await one(m, n)

        return await asyncio.gather(*(limited(m) for m in items))

    asyncio.run(run_all(work[:concurrency], 4))  # warm-up
    t0 = time.perf_counter()
    results = asyncio.run(run_all(work, max_tokens))
    return time.perf_counter() - t0, results


# ==== main ========================================================================================


def summarise(name: str, seconds: float, results: list[dict]) -> dict:
    ok = [r for r in results if "error" not in r]
    ttfts = [r["ttft"] for r in ok if r["ttft"] is not None]
    tokens = sum(r["tokens"] for r in ok)
    return {"name": name, "seconds": seconds, "tokens": tokens, "tok_s": tokens / seconds if seconds else 0.0,
            "req_s": len(ok) / seconds if seconds else 0.0, "ttft_p50_ms": 1000 * percentile(ttfts, 50),
            "ttft_p99_ms": 1000 * percentile(ttfts, 99), "errors": len(results) - len(ok)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2, help="alternating HTTP / in-process runs (medians reported)")
    ap.add_argument("--server", choices=["process", "thread"], default="process")
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        serve_main(args.threads)
        return 0

    import torch

    torch.set_num_threads(args.threads)
    from sgrt.engine import Engine
    from sgrt.models import load_model
    from sgrt.server.http.server import HttpServerThread

    work = workload(args.requests)
    proc = thread_server = None
    if args.server == "process":
        proc, url = start_server_process(args.threads)
    engine = Engine(model=load_model(MODEL, dtype="float32", device="cpu"), max_total_tokens=16384)
    if args.server == "thread":
        thread_server = HttpServerThread(engine, model_name=MODEL).start()
        url = thread_server.url
    http_runs, local_runs = [], []
    try:
        for r in range(args.rounds):  # alternate (and swap the order), so that load hits both alike
            for kind in (("http", "local") if r % 2 == 0 else ("local", "http")):
                if kind == "http":
                    http_runs.append(summarise(f"HTTP ({args.server}) #{r + 1}",
                                               *run_http(url, work, args.concurrency, args.max_tokens)))
                    flush(url)
                else:
                    local_runs.append(summarise(f"in-process #{r + 1}",
                                                *run_inprocess(engine, work, args.concurrency, args.max_tokens)))
                    engine.flush_cache()
    finally:
        if thread_server is not None:
            thread_server.stop()
        engine.shutdown()
        if proc is not None:
            proc.stdin.close()  # the child closes its server and exits
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()

    http_sum, local_sum = median_run(http_runs, f"HTTP ({args.server}), median"), \
        median_run(local_runs, "in-process, median")
    rows = [[s["name"], s["seconds"], s["tokens"], s["tok_s"], s["req_s"], s["ttft_p50_ms"], s["ttft_p99_ms"],
             s["errors"]] for s in http_runs + local_runs + [http_sum, local_sum]]
    print(f"{args.requests} streaming chat requests, concurrency {args.concurrency}, {args.max_tokens} tokens each "
          f"(EOS ignored), greedy, float32, {args.threads} threads, {args.rounds} alternating rounds")
    print_table(["run", "seconds", "tokens", "out tok/s", "req/s", "TTFT p50 ms", "TTFT p99 ms", "errors"], rows)
    ratio = http_sum["tok_s"] / local_sum["tok_s"] if local_sum["tok_s"] else 0.0
    print(f"throughput ratio HTTP / in-process (medians): {ratio:.3f} (target >= 0.9)")
    emit_json("http_load", requests=args.requests, concurrency=args.concurrency, max_tokens=args.max_tokens,
              threads=args.threads, server=args.server, rounds=args.rounds,
              http_tok_s=round(http_sum["tok_s"], 2), inprocess_tok_s=round(local_sum["tok_s"], 2),
              throughput_ratio=round(ratio, 4),
              http_ttft_p50_ms=round(http_sum["ttft_p50_ms"], 1), http_ttft_p99_ms=round(http_sum["ttft_p99_ms"], 1),
              inprocess_ttft_p50_ms=round(local_sum["ttft_p50_ms"], 1),
              inprocess_ttft_p99_ms=round(local_sum["ttft_p99_ms"], 1),
              http_req_s=round(http_sum["req_s"], 3), inprocess_req_s=round(local_sum["req_s"], 3),
              http_tok_s_runs=[round(s["tok_s"], 2) for s in http_runs],
              inprocess_tok_s_runs=[round(s["tok_s"], 2) for s in local_runs],
              http_errors=sum(s["errors"] for s in http_runs), inprocess_errors=sum(s["errors"] for s in local_runs))
    return 0 if all(s["errors"] == 0 for s in http_runs + local_runs) else 1


def median_run(runs: list[dict], name: str) -> dict:
    """Per figure, the median over the runs."""
    keys = ("seconds", "tokens", "tok_s", "req_s", "ttft_p50_ms", "ttft_p99_ms", "errors")
    return {"name": name, **{k: statistics.median(r[k] for r in runs) for k in keys}}


def flush(url: str) -> None:
    host, port = url.split("://", 1)[1].rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request("POST", "/flush_cache")
    conn.getresponse().read()
    conn.close()


if __name__ == "__main__":
    sys.exit(main())
