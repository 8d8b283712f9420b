"""int4 against bfloat16 at each batch size: decode throughput of the in-process engine (issue 39).

For each batch size B in ``--batches`` (default 1, 4, 16, 64) the engine runs 2*B requests at
concurrency B, each a short prompt (~40 tokens) and ``--tokens`` generated tokens (greedy, EOS
ignored), so nearly all of the time is decode steps of B rows. Output tok/s counts the generated
tokens over the wall time. The variants (default ``int4`` and ``bfloat16``, the default model's
GGUF Q4_1 blocks with bfloat16 activations against plain bfloat16 weights) are loaded once each
and alternated per round; the table gives medians and int4 / bfloat16 per batch size. Issue 39's
target: int4 >= bfloat16 at every batch size. ``SGRT_WOQ_DENSE_ROWS`` (see ``sgrt/kernels/woq.py``)
moves int4 steps of at least that many rows to the dense kernel; set it to compare.

Run: ``python bench/batch_sizes.py [--batches 1,4,16,64] [--tokens 64] [--rounds 2] [--threads 2]``
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.common import emit_json, print_table  # noqa: E402
from bench.workloads import filler  # noqa: E402

MODEL = "smollm2-135m-instruct"


def rate(engine, batch: int, tokens: int, seed: int) -> float:
    """Output tok/s of ``2 * batch`` requests at concurrency ``batch``."""
    from sgrt.engine import SamplingParams

    rng = random.Random(seed)
    prompts = [f"Note {seed}-{i}: " + filler(rng, 30) for i in range(2 * batch)]
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(batch) as pool:
        produced = sum(pool.map(lambda p: engine.generate(p, params).completion_tokens, prompts))
    return produced / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,4,16,64")
    ap.add_argument("--variants", default="int4,bfloat16")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from sgrt.engine import Engine, SamplingParams
    from sgrt.models import load_model

    batches = [int(b) for b in args.batches.split(",")]
    engines = {}
    for variant in args.variants.split(","):
        loaded = (load_model(MODEL, dtype=variant) if variant in ("float32", "bfloat16")
                  else load_model(MODEL, dtype="bfloat16", quantization=variant))
        engines[variant] = Engine(model=loaded, max_running_requests=max(batches))
        engines[variant].generate("Warm up.", SamplingParams(max_tokens=4))
    rates: dict[tuple[str, int], list[float]] = {}
    try:
        for r in range(args.rounds):
            for batch in batches:
                order = list(engines.items())
                for variant, engine in (order if r % 2 == 0 else order[::-1]):  # alternate who goes first
                    engine.flush_cache()  # each round prefills its prompts, as a new batch would
                    rates.setdefault((variant, batch), []).append(rate(engine, batch, args.tokens, seed=r))
    finally:
        for engine in engines.values():
            engine.shutdown()
    variants = list(engines)
    rows, figures = [], {}
    for batch in batches:
        med = {v: statistics.median(rates[(v, batch)]) for v in variants}
        ratio = med["int4"] / med["bfloat16"] if {"int4", "bfloat16"} <= med.keys() else None
        rows.append([batch, *(med[v] for v in variants), "-" if ratio is None else f"{ratio:.2f}"])
        figures[str(batch)] = {**{v: round(med[v], 1) for v in variants}, "ratio": ratio and round(ratio, 3)}
    print(f"{MODEL}, {args.threads} threads, {args.tokens} tokens a request, {args.rounds} rounds, "
          f"SGRT_WOQ_DENSE_ROWS={os.environ.get('SGRT_WOQ_DENSE_ROWS', '')!r}, load {os.getloadavg()[0]:.2f}")
    print_table(["batch", *(f"{v} tok/s" for v in variants), "int4 / bfloat16"], rows)
    emit_json("batch_sizes", batches=figures, load=os.getloadavg())


if __name__ == "__main__":
    main()
