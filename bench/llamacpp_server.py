"""llama.cpp's own HTTP server (``llama-server``) on a GGUF, from the ``xllamacpp`` wheel.

``xllamacpp`` (PyPI, prebuilt CPU wheels, built with ``LLAMA_LLGUIDANCE=ON``) links llama.cpp's
server; ``xllamacpp.Server(CommonParams)`` loads the model and listens on
``CommonParams.hostnames`` / ``port`` in a background thread, serving the same endpoints as
``llama-server`` (``/v1/models`` with ``owned_by: "llamacpp"``, ``/v1/completions``,
``/v1/chat/completions``, ``/completion``, ``/tokenize``, ``/props``). This script keeps that
server up until SIGTERM / SIGINT, so ``bench/scale_out.py`` can run it as a process it stops.

Run: ``python bench/llamacpp_server.py --model FILE.gguf --port 8080 [--alias NAME] [--ctx 4096]
[--parallel 4] [--threads 1]``
"""
from __future__ import annotations

import argparse
import signal
import sys
import threading


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="the GGUF file")
    ap.add_argument("--alias", default=None, help="the model id /v1/models answers")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--ctx", type=int, default=4096, help="KV cache size in tokens, shared by the slots")
    ap.add_argument("--parallel", type=int, default=4, help="slots (concurrent requests)")
    ap.add_argument("--threads", type=int, default=1, help="CPU threads for decode and prefill")
    args = ap.parse_args()

    import xllamacpp

    params = xllamacpp.CommonParams()
    params.model.path = args.model
    if args.alias:
        params.model_alias = {args.alias}
    params.hostnames = [args.host]
    params.port = args.port
    params.n_ctx = args.ctx
    params.n_parallel = args.parallel
    params.cpuparams.n_threads = args.threads
    params.cpuparams_batch.n_threads = args.threads
    server = xllamacpp.Server(params)
    print(f"llama.cpp server (xllamacpp {xllamacpp.__version__}) on {server.listening_address}", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(1.0):
        pass
    del server
    sys.exit(0)


if __name__ == "__main__":
    main()
