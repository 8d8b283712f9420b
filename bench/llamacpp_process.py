"""llama.cpp in its own process, for benchmarks that compare it with sgrt (issue 21).

Why a process of its own: llama.cpp's CPU backend and torch both run their threads on OpenMP,
and in one process they share one libgomp (torch's, which is loaded first). libgomp counts the
threads of every thread's team together, and once they outnumber the CPUs it cuts the spin-wait
of idle team threads to ~100 iterations, so every parallel region of both engines then pays a
futex wake-up. Measured on the 2-core development machine: a 1536 x 576 int4 linear call went
from 27 to 45 us once llama.cpp had run in the process, sgrt's batch-1 decode from ~67 to
~40 tok/s, and llama.cpp's own decode from 65-81 to 56-60 tok/s. Each engine alone in its
process, as users run them, is the fair comparison.

The child imports no torch. It loads one GGUF file with ``xllamacpp`` (llama.cpp's server,
driven without HTTP), or ``llama-cpp-python`` where that is the one importable, and answers
requests read from stdin, one JSON object a line::

    {"op": "decode", "ids": [...], "new_tokens": 128}  ->  {"tok_s": float}
    {"op": "prefill", "ids": [...]}                     ->  {"tok_s": float}

Its first line out is ``{"ready": true, "version": "..."}``; EOF on stdin ends it (exit 0).
:class:`LlamaCppProcess` is the parent's side.

Run by hand: ``python bench/llamacpp_process.py --model FILE.gguf --threads 2 --ctx 1088 --batch 1024``
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


class XLlamaCpp:
    """llama.cpp's server (``xllamacpp.Server``, no HTTP) on one GGUF file: one slot, greedy,
    ``threads`` threads for decode and prefill, no prompt cache (every request prefills)."""

    def __init__(self, path: str, threads: int, n_ctx: int, n_batch: int):
        import xllamacpp

        params = xllamacpp.CommonParams()
        params.model.path = path
        params.n_ctx, params.n_batch, params.n_ubatch, params.n_parallel = n_ctx, n_batch, n_batch, 1
        params.cpuparams.n_threads = params.cpuparams_batch.n_threads = threads
        params.verbosity = -1
        self.server = xllamacpp.Server(params)
        self.version = f"xllamacpp {_version('xllamacpp')}; {xllamacpp.get_system_info().strip()}"

    def _complete(self, prompt_ids: list[int], n_predict: int) -> dict:
        out = self.server.handle_completions({
            "prompt": list(prompt_ids), "n_predict": n_predict, "ignore_eos": True, "temperature": 0.0,
            "top_k": 1, "cache_prompt": False, "stream": False})
        if "timings" not in out:
            raise RuntimeError(f"llama.cpp server answered without timings: {str(out)[:300]}")
        return out["timings"]

    def decode_tps(self, prompt_ids: list[int], new_tokens: int) -> float:
        return float(self._complete(prompt_ids, new_tokens)["predicted_per_second"])

    def prefill_tps(self, prompt_ids: list[int]) -> float:
        return float(self._complete(prompt_ids, 1)["prompt_per_second"])


class LlamaCppPython:
    """llama.cpp through llama-cpp-python on one GGUF file (greedy, ``threads`` threads)."""

    def __init__(self, path: str, threads: int, n_ctx: int, n_batch: int):
        from llama_cpp import Llama

        self.llm = Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=n_ctx,
                         n_batch=n_batch, n_ubatch=n_batch, verbose=False)
        self.version = f"llama-cpp-python {_version('llama_cpp_python')}"

    def _next(self) -> int:
        scores = self.llm.scores[self.llm.n_tokens - 1]
        return int(max(range(len(scores)), key=scores.__getitem__))

    def decode_tps(self, prompt_ids: list[int], new_tokens: int) -> float:
        self.llm.reset()
        self.llm.eval(prompt_ids)
        start = time.perf_counter()
        for _ in range(new_tokens):
            self.llm.eval([self._next()])
        return new_tokens / (time.perf_counter() - start)

    def prefill_tps(self, prompt_ids: list[int]) -> float:
        self.llm.reset()
        start = time.perf_counter()
        self.llm.eval(prompt_ids)
        return len(prompt_ids) / (time.perf_counter() - start)


def _version(dist: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return "?"


def runner_module() -> str | None:
    """The llama.cpp binding the child will use: ``xllamacpp`` (the ``bench`` extra) where
    installed, else ``llama_cpp`` (llama-cpp-python), else None. Looked up without importing."""
    from importlib.util import find_spec

    for module in ("xllamacpp", "llama_cpp"):
        if find_spec(module) is not None:
            return module
    return None


class LlamaCppProcess:
    """The parent's side: starts this file as a child process on ``path`` and asks it for tok/s.

    Args:
        path: the GGUF file.
        threads: llama.cpp's threads for decode and prefill.
        n_ctx, n_batch: its context size and batch (prefill chunk) in tokens.

    Raises:
        RuntimeError: the child exited or answered an error (its stderr's tail is in the message).
    """

    def __init__(self, path: str, threads: int, n_ctx: int, n_batch: int):
        cmd = [sys.executable, str(Path(__file__).resolve()), "--model", path, "--threads", str(threads),
               "--ctx", str(n_ctx), "--batch", str(n_batch)]
        # stderr (llama.cpp's log) goes to a file: a pipe nobody reads could fill and stall the child
        self._log = tempfile.TemporaryFile(mode="w+")
        self._proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
                                      text=True, bufsize=1)
        self.version = self._read()["version"]

    @property
    def pid(self) -> int:
        return self._proc.pid

    def _read(self) -> dict:
        line = self._proc.stdout.readline()
        if not line:
            self._log.seek(0)
            err = self._log.read()[-2000:]
            raise RuntimeError(f"llama.cpp child exited ({self._proc.wait()}): {err}")
        answer = json.loads(line)
        if "error" in answer:
            raise RuntimeError(f"llama.cpp child: {answer['error']}")
        return answer

    def _ask(self, request: dict) -> dict:
        self._proc.stdin.write(json.dumps(request) + "\n")
        self._proc.stdin.flush()
        return self._read()

    def decode_tps(self, prompt_ids: list[int], new_tokens: int) -> float:
        """Greedy decode of ``new_tokens`` tokens after ``prompt_ids`` (EOS ignored): tok/s."""
        return float(self._ask({"op": "decode", "ids": list(prompt_ids), "new_tokens": new_tokens})["tok_s"])

    def prefill_tps(self, prompt_ids: list[int]) -> float:
        """One forward over ``prompt_ids``: tok/s."""
        return float(self._ask({"op": "prefill", "ids": list(prompt_ids)})["tok_s"])

    def close(self) -> int:
        """Ends the child (EOF on its stdin); returns its exit status."""
        if self._proc.poll() is None:
            self._proc.stdin.close()
            try:
                return self._proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self._proc.kill()
        return self._proc.wait()

    def __enter__(self) -> "LlamaCppProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def serve() -> None:
    """The child: load the model, then answer one JSON request a line until EOF."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="the GGUF file")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=1088)
    ap.add_argument("--batch", type=int, default=1024)
    args = ap.parse_args()
    # The answers get their own copy of stdout; fd 1 then points at stderr, so that whatever
    # llama.cpp's C code prints cannot land among them.
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    module = runner_module()
    if module is None:
        print(json.dumps({"error": "neither xllamacpp nor llama-cpp-python is installed"}), file=answers)
        sys.exit(2)
    cls = XLlamaCpp if module == "xllamacpp" else LlamaCppPython
    engine = cls(args.model, args.threads, args.ctx, args.batch)
    print(json.dumps({"ready": True, "version": engine.version}), file=answers)
    for line in sys.stdin:
        request = json.loads(line)
        try:
            if request["op"] == "decode":
                answer = {"tok_s": engine.decode_tps(request["ids"], int(request["new_tokens"]))}
            elif request["op"] == "prefill":
                answer = {"tok_s": engine.prefill_tps(request["ids"])}
            else:
                answer = {"error": f"unknown op {request['op']!r} (decode, prefill)"}
        except Exception as exc:  # reported to the parent, which raises it
            answer = {"error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(answer), file=answers)


if __name__ == "__main__":
    serve()
