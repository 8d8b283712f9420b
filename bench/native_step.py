"""The one-call native decode step against the per-layer native path, in one process (issue 21).

For each model, ``CausalLM.forward`` of one new token on an ``--context``-token context: the
per-layer path (``DecoderLayer.forward`` with the fused operators: ``ops=model.layer_ops``)
and the one-call step (``sgrt.models.native_step``: the whole stack in one C++ call), alternated
``--rounds`` times. Times are the calling thread's CPU time (``time.thread_time``: less moved by
other tenants of a shared machine than wall time; with ``--threads 1`` the whole forward runs on
this thread), medians in ms; the ratio is per-layer / one-call (above 1: the step is faster).
Both paths give bit-identical hidden states (checked here once per model too).

``--engine N``: also batch-1 engine decode, output tok/s of one request of ``N`` new tokens
after a 60-token prompt (wall time of the engine's step loop: scheduler, sampler and all), with
the model's one-call step switched off and on, alternated; medians.

Run: ``python bench/native_step.py [--models smollm2:int4,smollm2:bfloat16,smollm2:float32,gemma3:int4]
[--threads 1] [--rounds 40] [--context 80] [--engine 64 --engine-rounds 5]``
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.common import emit_json, print_table  # noqa: E402

MODELS = {"smollm2": "smollm2-135m-instruct", "gemma3": "gemma3-270m-q4-k-m"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="smollm2:int4,smollm2:bfloat16,smollm2:float32,gemma3:int4",
                    help="comma list of model:int4|int8|bfloat16|float32")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--context", type=int, default=80)
    ap.add_argument("--engine", type=int, default=0, help="new tokens of the engine decode runs (0: skip)")
    ap.add_argument("--engine-rounds", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from sgrt.engine.attention import PagedAttention, RowSpec
    from sgrt.engine.kv_pool import KVPool
    from sgrt.models import load_model

    rows, figures = [], {}
    for item in args.models.split(","):
        name, kind = item.split(":")
        quant = kind if kind in ("int4", "int8") else "none"
        dtype = "bfloat16" if quant != "none" else kind
        loaded = load_model(MODELS[name], dtype=dtype, quantization=quant)
        model = loaded.model
        if model.native_step is None:
            print(f"{item}: no one-call step for this model here (see the log)")
            continue
        cfg = model.config
        pool = KVPool(args.context + 8, cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim,
                      model.dtype, model.device)
        spec = [RowSpec(list(range(1, args.context + 1)), 1)]
        ids, positions = torch.tensor([123]), torch.tensor([args.context - 1])
        paths = {"per_layer": model.layer_ops, "one_call": None}
        samples: dict[str, list[float]] = {p: [] for p in paths}
        with torch.inference_mode():
            outs = {p: model(ids, positions, PagedAttention(pool, spec, cascade=False, native=True), ops=ops)
                    for p, ops in paths.items()}
            assert torch.equal(outs["per_layer"], outs["one_call"]), "the paths disagree"
            for _ in range(3):  # warm-up
                for ops in paths.values():
                    model(ids, positions, PagedAttention(pool, spec, cascade=False, native=True), ops=ops)
            for _ in range(args.rounds):
                for p, ops in paths.items():
                    attn = PagedAttention(pool, spec, cascade=False, native=True)
                    t0 = time.thread_time()
                    model(ids, positions, attn, ops=ops)
                    samples[p].append((time.thread_time() - t0) * 1e3)
        old, new = (statistics.median(samples[p]) for p in paths)
        key = f"{name}_{kind}"
        figures[f"{key}_per_layer_ms"], figures[f"{key}_one_call_ms"] = round(old, 3), round(new, 3)
        figures[f"{key}_ratio"] = round(old / new, 3)
        row = [item, old, new, old / new]
        if args.engine:
            tps = engine_tps(loaded, args.engine, args.engine_rounds)
            figures[f"{key}_engine_per_layer_tok_s"] = round(tps["per_layer"], 1)
            figures[f"{key}_engine_one_call_tok_s"] = round(tps["one_call"], 1)
            figures[f"{key}_engine_ratio"] = round(tps["one_call"] / tps["per_layer"], 3)
            row += [tps["per_layer"], tps["one_call"], tps["one_call"] / tps["per_layer"]]
        rows.append(row)
        del model, pool, loaded
    print(f"CausalLM.forward, 1 token at {args.context} tokens of context, {args.threads} thread(s), "
          f"thread CPU time, median of {args.rounds} alternating rounds (ms)")
    headers = ["model", "per-layer ms", "one call ms", "per-layer / one call"]
    if args.engine:
        headers += ["engine per-layer tok/s", "engine one call tok/s", "one call / per-layer"]
    print_table(headers, rows)
    emit_json("native_step", threads=args.threads, rounds=args.rounds, context=args.context, **figures)


def engine_tps(loaded, new_tokens: int, rounds: int) -> dict[str, float]:
    """Batch-1 decode tok/s of the engine with the one-call step off ("per_layer") and on."""
    from sgrt.engine import Engine, SamplingParams

    model = loaded.model
    step = model.native_step
    prompt = loaded.tokenizer.encode("The harbour was quiet that morning; the fishing boats had left before dawn "
                                     "and only the gulls remained, circling the empty quay. " * 3)[:60]
    engine = Engine(model=loaded, max_total_tokens=1024, enable_radix_cache=False)
    samples: dict[str, list[float]] = {"per_layer": [], "one_call": []}
    try:
        engine.generate(prompt, SamplingParams(max_tokens=8, ignore_eos=True))  # warm-up
        for _ in range(rounds):
            for side in samples:
                model.native_step = step if side == "one_call" else None
                result = engine.generate(prompt, SamplingParams(max_tokens=new_tokens, ignore_eos=True))
                samples[side].append(result.output_tok_per_s)
    finally:
        model.native_step = step
        engine.shutdown()
    return {side: statistics.median(v) for side, v in samples.items()}


if __name__ == "__main__":
    main()
