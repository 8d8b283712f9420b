"""Where a batch-1 engine decode step's time goes, this tree against a base commit (issue 21).

Each side runs ``Engine.generate`` (one request, ``--tokens`` greedy tokens, after a warm-up) in
its own process, with its own tree first on ``sys.path`` (the base commit exported with ``git
archive``), alternating base / new ``--rounds`` times. The engine loop thread's CPU time
(``time.thread_time``: what the step costs that thread, less sensitive to other processes on a
shared machine than wall time) is split per step into:

- ``layers``: ``CausalLM.forward`` (the decoder stack);
- ``lm_head``: ``CausalLM.compute_logits``;
- ``attn_meta``: building the step's ``PagedAttention`` (slot tables);
- ``process``: ``OutputProcessor.process`` (sampling, appending, stop checks, streaming);
- ``outside``: the whole step less ``layers`` and ``lm_head`` (scheduling, drafts, the runner's
  tensors, ``attn_meta``, ``process``, the loop's own work);

plus ``step`` (all of it) and the request's output tok/s (wall clock). Figures are medians over
rounds, in ms a step; ``new / base`` ratios per item. With ``--threads 2`` the loop thread's CPU
time also counts its OpenMP spinning, so use 1 thread for the split.

``--context N``: a prompt of N tokens (the short one repeated), cached by the radix cache in the
warm-up, so that the timed request prefills one token and its steps attend over N keys: what a
step's Python costs grows with the context (the slot tables, the prefix cache's walks at
admission and finish). ``--kv-cache-dtype int8``: the engine's int8 K/V pool.

Run: ``python bench/engine_step.py --base main [--quantization int4] [--dtype bfloat16]
[--model smollm2-135m-instruct] [--threads 1] [--rounds 3] [--tokens 128] [--context 8000]
[--kv-cache-dtype int8]``
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ITEMS = ("step", "layers", "lm_head", "attn_meta", "process", "outside")


def measure(args: argparse.Namespace) -> dict[str, float]:
    """In this process (the tree first on ``sys.path``): one timed generation's split, ms a step."""
    import time
    from collections import defaultdict

    import torch

    torch.set_num_threads(args.threads)
    import sgrt.engine.model_runner as model_runner
    from sgrt.engine import Engine, SamplingParams
    from sgrt.models import load_model

    quant = None if args.quantization == "none" else args.quantization
    loaded = load_model(args.model, dtype=args.dtype, quantization=quant)
    options = {"kv_cache_dtype": args.kv_cache_dtype} if args.kv_cache_dtype != "auto" else {}
    engine = Engine(model=loaded, max_total_tokens=args.tokens + args.context + 512,
                    enable_radix_cache=args.context > 0, **options)
    spent: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)

    def timed_call(fn, item):
        def call(*a, **k):
            t0 = time.thread_time()
            try:
                return fn(*a, **k)
            finally:
                spent[item] += time.thread_time() - t0
                calls[item] += 1
        return call

    engine.step = timed_call(engine.step, "step")
    engine.model.forward = timed_call(engine.model.forward, "layers")
    engine.model.compute_logits = timed_call(engine.model.compute_logits, "lm_head")
    engine.outputs.process = timed_call(engine.outputs.process, "process")
    model_runner.PagedAttention = timed_call(model_runner.PagedAttention, "attn_meta")
    prompt = loaded.tokenizer.encode("Write a long story about a dragon who learns to cook, in the style of a "
                                     "fairy tale, with a moral at the end.")
    if args.context > 0:
        prompt = (prompt * (args.context // len(prompt) + 1))[: args.context]
    try:
        engine.generate(prompt, SamplingParams(max_tokens=8, ignore_eos=True))  # warm-up
        spent.clear()
        calls.clear()
        result = engine.generate(prompt, SamplingParams(max_tokens=args.tokens, ignore_eos=True))
    finally:
        engine.shutdown()
    steps = calls["layers"]  # (decode steps and the prefill; idle steps do no forward)
    out = {item: spent[item] / steps * 1e3 for item in ITEMS[:-1]}
    out["outside"] = out["step"] - out["layers"] - out["lm_head"]
    out["tok_per_s"] = result.output_tok_per_s
    return out


def export_tree(rev: str, into: Path) -> Path:
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def run_side(tree: Path, args: argparse.Namespace) -> dict[str, float]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", str(tree), "--model", args.model,
           "--dtype", args.dtype, "--quantization", args.quantization, "--threads", str(args.threads),
           "--tokens", str(args.tokens), "--context", str(args.context), "--kv-cache-dtype", args.kv_cache_dtype]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=tree).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", default=None, help="the commit to compare with (none: this tree only)")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--quantization", default="int4")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--context", type=int, default=0, help="prompt tokens (0: one short sentence, no prefix cache)")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8"])
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        sys.path.insert(0, args.child)
        print(json.dumps(measure(args)))
        return
    sys.path.insert(0, str(ROOT))
    from bench.common import emit_json, print_table

    with tempfile.TemporaryDirectory() as tmp:
        sides = {"new": ROOT}
        if args.base:
            sides = {"base": export_tree(args.base, Path(tmp)), "new": ROOT}
        runs: dict[str, list[dict[str, float]]] = {side: [] for side in sides}
        for r in range(args.rounds):
            order = list(sides) if r % 2 == 0 else list(reversed(sides))  # ABBA
            for side in order:
                runs[side].append(run_side(sides[side], args))
    med = {side: {k: statistics.median(run[k] for run in rs) for k in (*ITEMS, "tok_per_s")}
           for side, rs in runs.items()}
    print(f"batch-1 decode step, engine loop thread CPU ms a step: {args.model} {args.quantization} / "
          f"{args.dtype}, {args.threads} threads, {args.tokens} tokens after {args.context or 'a short'} prompt"
          f" ({args.kv_cache_dtype} KV), median of {args.rounds} rounds"
          + (f", base {args.base}" if args.base else ""))
    headers = ["item", *sides] + (["new / base"] if args.base else [])
    rows = []
    figures: dict[str, float] = {}
    for k in (*ITEMS, "tok_per_s"):
        row = [k, *(med[s][k] for s in sides)]
        for s in sides:
            figures[f"{k}_{s}"] = round(med[s][k], 4)
        if args.base:
            row.append(med["new"][k] / med["base"][k])
            figures[f"{k}_ratio"] = round(med["new"][k] / med["base"][k], 3)
        rows.append(row)
    print_table(headers, rows)
    emit_json("engine_step", base=args.base, model=args.model, quantization=args.quantization, dtype=args.dtype,
              threads=args.threads, rounds=args.rounds, tokens=args.tokens, context=args.context,
              kv_cache_dtype=args.kv_cache_dtype, **figures)


if __name__ == "__main__":
    main()
