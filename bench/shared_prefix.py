"""Shared prefix: 32 requests that share a 1,000-token system prompt, with the radix cache on
and off (same engine options otherwise, same run).

Each request has its own ~20-token question and generates 32 tokens (EOS ignored). Reports
prefill tokens actually computed, cache hit rate and end-to-end time. Targets: hit rate >= 90%
and >= 3x faster end to end with the cache.

Run: ``python bench/shared_prefix.py``
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.common import emit_json, print_table  # noqa: E402
from bench.workloads import filler  # noqa: E402


def build_prompts(tokenizer, n: int, prefix_tokens: int) -> list[str]:
    rng = random.Random(1)
    words = int(prefix_tokens * 0.75)
    system = filler(rng, words)
    while len(tokenizer.encode(system)) < prefix_tokens:
        words += 10
        system = filler(random.Random(1), words)
    prompts = []
    for i in range(n):
        question = f"Question {i}: which word appears most often in the text about {rng.choice(['rivers', 'engines', 'music', 'winter'])}?"
        prompts.append(tokenizer.apply_chat_template(
            [{"role": "system", "content": system}, {"role": "user", "content": question}]))
    return prompts


def run(loaded, prompts: list[str], cache: bool, out_tokens: int) -> tuple[float, dict]:
    from sgrt.engine import Engine, SamplingParams

    engine = Engine(model=loaded, max_total_tokens=40000, enable_radix_cache=cache, max_running_requests=64)
    try:
        t0 = time.perf_counter()
        results = engine.generate_batch(prompts, SamplingParams(max_tokens=out_tokens, ignore_eos=True))
        seconds = time.perf_counter() - t0
        assert all(r.completion_tokens == out_tokens for r in results)
        return seconds, engine.stats()
    finally:
        engine.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prefix-tokens", type=int, default=1000)
    ap.add_argument("--out-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from sgrt.models import load_model

    loaded = load_model("smollm2-135m-instruct", dtype="float32")
    prompts = build_prompts(loaded.tokenizer, args.requests, args.prefix_tokens)
    on_s, on = run(loaded, prompts, True, args.out_tokens)
    off_s, off = run(loaded, prompts, False, args.out_tokens)
    print(f"{args.requests} requests, shared prefix ~{args.prefix_tokens} tokens, {args.out_tokens} output tokens each")
    print_table(["radix cache", "seconds", "prefill tokens computed", "hit rate"], [
        ["on", on_s, on["prefill_tokens"], on["cache_hit_rate"]],
        ["off", off_s, off["prefill_tokens"], off["cache_hit_rate"]],
    ])
    print(f"speed-up: {off_s / on_s:.2f}x (target >= 3x); hit rate {on['cache_hit_rate']:.1%} (target >= 90%)")
    emit_json("shared_prefix", requests=args.requests, seconds_cache=round(on_s, 2), seconds_no_cache=round(off_s, 2),
              speedup=round(off_s / on_s, 3), hit_rate=round(on["cache_hit_rate"], 4),
              prefill_tokens_cache=on["prefill_tokens"], prefill_tokens_no_cache=off["prefill_tokens"])


if __name__ == "__main__":
    main()
