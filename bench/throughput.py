"""Serving throughput: sgrt continuous batching vs transformers ``generate()`` in static batches.

64 chat requests from a seeded generator (prompts of 50 to 500 tokens, ``max_tokens`` drawn
from 16 to 256, EOS ignored), float32, 2 threads. sgrt runs them at concurrency 16 (a new
request starts as soon as one finishes); transformers runs static left-padded batches of 16,
each batch running to its longest request. Output tok/s counts the requested tokens only.
Target: sgrt >= 2x.

``--variants bfloat16,int4`` adds sgrt rows for the same workload in those forms (``int4``: the
GGUF's Q4_1 blocks with bfloat16 activations, as ``load_model(..., quantization="int4")``), each
with its ratio to transformers' float32 static batches and to sgrt bfloat16 (issue 21's targets:
int4 >= bfloat16 and >= 3x transformers). The sgrt rows run one after another in one process.

Run: ``python bench/throughput.py [--requests 64] [--concurrency 16] [--variants bfloat16,int4]``
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.common import emit_json, hf_folder, print_table  # noqa: E402
from bench.workloads import prompt_of_tokens  # noqa: E402


def make_workload(tokenizer, n: int, seed: int) -> list[tuple[str, int]]:
    rng = random.Random(seed)
    return [(prompt_of_tokens(tokenizer, rng, rng.randint(50, 500)), rng.randint(16, 256)) for _ in range(n)]


def run_sgrt(loaded, work: list[tuple[str, int]], concurrency: int) -> tuple[float, dict]:
    from sgrt.engine import Engine, SamplingParams

    engine = Engine(model=loaded, max_total_tokens=16384, max_running_requests=concurrency)
    try:
        engine.generate(work[0][0], SamplingParams(max_tokens=4))  # warm-up
        engine.flush_cache()

        def one(item: tuple[str, int]) -> int:
            prompt, max_tokens = item
            return engine.generate(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True)).completion_tokens

        t0 = time.perf_counter()
        with ThreadPoolExecutor(concurrency) as pool:
            produced = sum(pool.map(one, work))
        seconds = time.perf_counter() - t0
        assert produced == sum(m for _, m in work)
        return seconds, engine.stats()
    finally:
        engine.shutdown()


def run_hf(path: Path, tokenizer, work: list[tuple[str, int]], batch: int) -> float:
    import transformers

    model = transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True).eval()
    t0 = time.perf_counter()
    for i in range(0, len(work), batch):
        chunk = work[i: i + batch]
        encoded = [tokenizer.encode(p) for p, _ in chunk]
        width = max(len(e) for e in encoded)
        ids = torch.full((len(chunk), width), 2, dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for row, e in enumerate(encoded):
            ids[row, width - len(e):] = torch.tensor(e)
            mask[row, width - len(e):] = 1
        longest = max(m for _, m in chunk)
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=longest,
                           min_new_tokens=longest, do_sample=False, pad_token_id=2)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--variants", default="", help="extra sgrt rows: bfloat16, int8, int4 (comma list)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from sgrt.models import load_model

    loaded = load_model("smollm2-135m-instruct", dtype="float32")
    work = make_workload(loaded.tokenizer, args.requests, args.seed)
    tokens = sum(m for _, m in work)
    sgrt_s, stats = run_sgrt(loaded, work, args.concurrency)
    hf_s = run_hf(hf_folder(loaded), loaded.tokenizer, work, args.concurrency)
    ours, theirs = tokens / sgrt_s, tokens / hf_s
    print(f"{args.requests} requests, {tokens} output tokens, concurrency {args.concurrency}, float32")
    print_table(["system", "seconds", "output tok/s"], [
        ["sgrt (continuous batching)", sgrt_s, ours],
        [f"transformers generate (static batches of {args.concurrency})", hf_s, theirs],
    ])
    print(f"ratio: {ours / theirs:.2f}x (target >= 2x); sgrt retracted {stats['retracted']} requests")
    extra = run_variants([v for v in args.variants.split(",") if v], work, args.concurrency, tokens, theirs)
    emit_json("throughput", requests=args.requests, concurrency=args.concurrency, output_tokens=tokens,
              sgrt_seconds=round(sgrt_s, 2), hf_seconds=round(hf_s, 2), sgrt_tok_s=round(ours, 2),
              hf_tok_s=round(theirs, 2), ratio=round(ours / theirs, 3), **extra)


def run_variants(variants: list[str], work: list[tuple[str, int]], concurrency: int, tokens: int,
                 hf_tok_s: float) -> dict:
    """sgrt on the same workload in other dtypes / quantizations; their rows and JSON figures."""
    from sgrt.models import load_model

    if not variants:
        return {}
    rates: dict[str, float] = {}
    for variant in variants:
        if variant in ("float32", "bfloat16"):
            loaded = load_model("smollm2-135m-instruct", dtype=variant)
        else:
            loaded = load_model("smollm2-135m-instruct", dtype="bfloat16", quantization=variant)
        seconds, _ = run_sgrt(loaded, work, concurrency)
        rates[variant] = tokens / seconds
        del loaded
    rows, figures = [], {}
    for variant, rate in rates.items():
        vs_bf16 = rate / rates["bfloat16"] if "bfloat16" in rates else None
        rows.append([f"sgrt {variant}", rate, rate / hf_tok_s, "-" if vs_bf16 is None else f"{vs_bf16:.2f}"])
        figures[f"sgrt_{variant}_tok_s"] = round(rate, 2)
        figures[f"sgrt_{variant}_over_hf"] = round(rate / hf_tok_s, 3)
        if vs_bf16 is not None:
            figures[f"sgrt_{variant}_over_bfloat16"] = round(vs_bf16, 3)
    print_table(["variant", "output tok/s", "/ transformers float32", "/ sgrt bfloat16"], rows)
    return figures


if __name__ == "__main__":
    main()
