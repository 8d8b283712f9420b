"""Speed beside other work on the same cores, and an idle server's CPU (issue 39).

1. **Batch-1 decode and concurrency-16 throughput with a busy core.** One in-process engine on
   the default model (int4, bfloat16 activations, all torch threads), measured quiet, then with
   ``--busy`` other processes spinning (``while True: pass``: one busy core of the 2), each with
   the thread governor on (``adaptive_threads``, the default) and off (every forward on all
   threads, what sgrt did before), alternated; ratio to the quiet, adaptive figure of the run. Target
   (issue 39): >= 0.4x quiet with one core busy (its physical share is ~0.5x).
2. **An idle server's CPU**: ``sgrt serve`` as a process, one streamed completion, then its CPU
   time over ``--idle`` seconds of nothing (``/proc/PID/stat``); target < 1% of a core.

The busy figures need a quiet machine apart from the spinners: run nothing else (say the load).

Run: ``python bench/contention.py [--tokens 128] [--busy 1] [--rounds 2] [--idle 5]``
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import emit_json, print_table  # noqa: E402

PROMPT = "Write a long story about a lighthouse keeper and the sea."


def spinners(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.kill()
        p.wait()


def decode_tps(engine, tokens: int) -> float:
    from sgrt.engine import SamplingParams

    r = engine.generate(PROMPT, SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))
    return (r.completion_tokens - 1) / (r.total_time - r.ttft)


def throughput(engine, tokens: int, concurrency: int = 16, requests: int = 32) -> float:
    from sgrt.engine import SamplingParams

    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    prompts = [f"{PROMPT} Chapter {i}." for i in range(requests)]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        done = list(pool.map(lambda p: engine.generate(p, params).completion_tokens, prompts))
    return sum(done) / (time.perf_counter() - t0)


def measure(engine, adaptive: bool, args) -> dict:
    engine.threads.adaptive = adaptive and engine.threads.max_threads > 1
    decode_tps(engine, 32)  # (warm: the governor learns the machine as it is now)
    return {"decode": statistics.median(decode_tps(engine, args.tokens) for _ in range(2)),
            "throughput": throughput(engine, args.tokens // 2)}


def idle_server_cpu(seconds: float) -> float:
    """Percent of a core an idle ``sgrt serve`` spends over ``seconds`` after one request."""
    import socket

    def free_port() -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "sgrt.cli", "serve", "--quantization", "int4", "--dtype",
                             "bfloat16", "--port", str(free_port()), "--http-port", str(port), "--quiet"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 300
        while time.time() < deadline:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2).read()
                break
            except OSError:
                time.sleep(0.5)
        body = json.dumps({"prompt": PROMPT, "max_tokens": 32, "stream": True}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                     {"Content-Type": "application/json"})
        urllib.request.urlopen(req, timeout=120).read()
        time.sleep(1.0)

        def cpu() -> float:
            fields = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime

        c0, t0 = cpu(), time.time()
        time.sleep(seconds)
        return 100 * (cpu() - c0) / (time.time() - t0)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--busy", type=int, default=1, help="spinning processes in the busy runs")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--idle", type=float, default=5.0, help="seconds of idle server to measure (0: skip)")
    args = ap.parse_args()
    from sgrt.engine import Engine

    engine = Engine(model=args.model, dtype="bfloat16", quantization="int4", max_total_tokens=8192)
    runs: dict[str, list[dict]] = {"quiet": [], "quiet, all threads": [], "busy, adaptive": [],
                                   "busy, all threads": []}
    try:
        for _ in range(args.rounds):
            runs["quiet"].append(measure(engine, True, args))
            runs["quiet, all threads"].append(measure(engine, False, args))
            busy = spinners(args.busy)
            try:
                time.sleep(0.5)
                for label, adaptive in (("busy, adaptive", True), ("busy, all threads", False)):
                    runs[label].append(measure(engine, adaptive, args))
            finally:
                stop(busy)
    finally:
        engine.shutdown()
    med = {k: {m: statistics.median(r[m] for r in v) for m in ("decode", "throughput")} for k, v in runs.items()}
    quiet = med["quiet"]
    rows = [[k, v["decode"], v["decode"] / quiet["decode"], v["throughput"], v["throughput"] / quiet["throughput"]]
            for k, v in med.items()]
    print(f"{args.model} int4, {engine.threads.max_threads} threads, {args.busy} spinning process(es), "
          f"load {os.getloadavg()[0]:.2f}")
    print_table(["run", "decode tok/s", "x quiet", "c16 tok/s", "x quiet"], rows)
    idle = idle_server_cpu(args.idle) if args.idle else None
    if idle is not None:
        print(f"idle sgrt serve: {idle:.2f}% of a core over {args.idle:.0f} s")
    emit_json("contention", medians=med, idle_server_cpu_percent=idle, busy=args.busy, load=os.getloadavg())


if __name__ == "__main__":
    main()
