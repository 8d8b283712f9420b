"""Decode speed: sgrt vs HF transformers ``generate()`` on the same model and prompt, unquantized
and with int8 / int4 weight-only linear layers (issue 10).

Same weights (the default model's converted HF folder; int4 takes the GGUF's Q4_1 blocks as they
are), a ~60-token prompt, 128 new tokens with EOS ignored, 2 threads, greedy, median of 5.

- Batch 1, for float32 and bfloat16 (against transformers in the same dtype) and for int8 / int4
  (bfloat16 activations; against our bfloat16 and transformers' bfloat16). Decode tok/s excludes
  the prefill: sgrt reports it per request (tokens after the first / time after the first); for
  transformers it is 127 / (time of 128 new tokens - time of 1 new token). Weight MB counts
  parameters and packed weights (the bfloat16 input embedding, 56.6 MB, included everywhere).
- Batch 16: 16 requests submitted at once (the same prompt, radix cache off, so each prefills),
  128 new tokens each; throughput = 16 * 128 / wall time, for bfloat16, int8 and int4.
  Targets: int4 >= 2.5x our bfloat16 at batch 1; at batch 16 no worse than bfloat16.
- All models are loaded first; then the sgrt runs alternate between them (one engine at a time,
  a fresh engine per run), so that the machine's drift lands on every row alike: on a shared
  machine the memory-bound quantized rows move most (10-25% between runs minutes apart).

- Prefill (``--prefill N``, default 1,024): N prompt tokens in one request, prompt tok/s = N / TTFT
  for sgrt (one chunk: ``chunked_prefill_size`` = N) and N / (time of one forward) for
  transformers, for each dtype.
- ``--model``: any spec sgrt loads (a name, a GGUF, an HF folder). transformers loads the same
  weights: the GGUF itself through its own GGUF reader (needs ``accelerate``) for a GGUF spec,
  the HF folder otherwise.

Run: ``python bench/decode.py [--model SPEC] [--dtypes float32,bfloat16] [--quantizations int8,int4]
[--batch 16] [--prefill 1024] [--runs 5] [--threads 2]``
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
# NOTE: OpenMP's wait policy is left as the environment sets it (libgomp's default: workers spin
# ~3 ms before sleeping), the same for both sides. Each side runs alone: transformers on this
# thread, sgrt on its engine thread, whose Engine frees this thread's idle pool so that libgomp
# does not throttle the spinning (sgrt/engine/openmp.py). OMP_WAIT_POLICY=PASSIVE makes every
# small matmul wake a sleeping worker and slows both sides (measured: sgrt ~20 vs ~29 tok/s).

import torch  # noqa: E402

from bench.common import emit_json, interleaved_medians, median_of, print_table, timed  # noqa: E402

PROMPT = (
    "You are a helpful assistant. Read the following note and continue it in the same style. "
    "The harbour was quiet that morning; the fishing boats had left before dawn and only the "
    "gulls remained, circling the empty quay while the tide came in."
)
NEW_TOKENS = 128


def sgrt_decode_tps(loaded, prompt_ids: list[int]) -> float:
    """One timed batch-1 generation on a fresh engine (after a short warm-up)."""
    from sgrt.engine import Engine, SamplingParams

    engine = Engine(model=loaded, max_total_tokens=1024, enable_radix_cache=False)
    try:
        engine.generate(prompt_ids, SamplingParams(max_tokens=8, ignore_eos=True))  # warm-up
        return engine.generate(prompt_ids, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)).output_tok_per_s
    finally:
        engine.shutdown()


def sgrt_batch_tps(loaded, prompt_ids: list[int], batch: int) -> float:
    """Output tok/s of ``batch`` concurrent requests (prefills included in the wall time), one
    timed run on a fresh engine after a short warm-up."""
    from sgrt.engine import Engine, SamplingParams

    engine = Engine(model=loaded, max_total_tokens=(len(prompt_ids) + NEW_TOKENS) * batch + 64,
                    enable_radix_cache=False, max_running_requests=batch)
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    try:
        engine.generate_batch([prompt_ids] * batch, SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
        seconds, results = timed(lambda: engine.generate_batch([prompt_ids] * batch, params))
        assert sum(r.completion_tokens for r in results) == batch * NEW_TOKENS
        return batch * NEW_TOKENS / seconds
    finally:
        engine.shutdown()


def sgrt_prefill_tps(loaded, prompt_ids: list[int]) -> float:
    """Prompt tok/s of one request of ``len(prompt_ids)`` tokens prefilled in one chunk."""
    from sgrt.engine import Engine, SamplingParams

    n = len(prompt_ids)
    engine = Engine(model=loaded, max_total_tokens=n + 64, enable_radix_cache=False,
                    chunked_prefill_size=n, max_prefill_tokens=n)
    try:
        engine.generate(prompt_ids[:64], SamplingParams(max_tokens=1))  # warm-up
        return n / engine.generate(prompt_ids, SamplingParams(max_tokens=1)).ttft
    finally:
        engine.shutdown()


def hf_model(loaded, dtype: torch.dtype):
    """transformers' model of the same weights: from the GGUF itself when sgrt loaded one."""
    import transformers

    kind, src = loaded.source.split(":", 1)
    if kind == "gguf":
        src = Path(src)
        return transformers.AutoModelForCausalLM.from_pretrained(
            str(src.parent), gguf_file=src.name, dtype=dtype, local_files_only=True).eval()
    return transformers.AutoModelForCausalLM.from_pretrained(src, dtype=dtype, local_files_only=True).eval()


def hf_prefill_tps(model, prompt_ids: list[int], runs: int) -> float:
    ids = torch.tensor([prompt_ids])
    with torch.inference_mode():
        model(ids[:, :64])  # warm-up
        return median_of(runs, lambda: len(prompt_ids) / timed(lambda: model(ids))[0])


def hf_decode_tps(model, prompt_ids: list[int], runs: int, pad_token_id: int) -> float:
    ids = torch.tensor([prompt_ids])
    kw = dict(do_sample=False, pad_token_id=pad_token_id)

    def gen(n: int) -> float:
        with torch.inference_mode():
            seconds, out = timed(lambda: model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw))
        assert out.shape[1] == ids.shape[1] + n
        return seconds

    gen(8)  # warm-up

    def one() -> float:
        return (NEW_TOKENS - 1) / (gen(NEW_TOKENS) - gen(1))

    return median_of(runs, one)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--quantizations", default="int8,int4", help="comma list; empty for none")
    ap.add_argument("--batch", type=int, default=16, help="batch-size row (0: skip)")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--prefill", type=int, default=1024, help="prefill-row prompt length (0: skip)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from sgrt.models import load_model
    from sgrt.models.quant import weight_bytes

    dtypes = [d for d in args.dtypes.split(",") if d]
    quants = [q for q in args.quantizations.split(",") if q]
    if quants and "bfloat16" not in dtypes:
        dtypes.append("bfloat16")  # the quantized rows' baseline
    rows, batch_rows, figures = [], [], {}
    models, hf_paths = {}, {}
    for name in dtypes + quants:
        quantized = name in quants
        models[name] = load_model(args.model, dtype="bfloat16" if quantized else name,
                                  quantization=name if quantized else "none")
        figures[f"{name}_weight_mb"] = round(weight_bytes(models[name].model) / 1e6, 1)
        if not quantized:
            hf_paths[name] = models[name].path
    tok = next(iter(models.values())).tokenizer
    prompt_ids = tok.encode_prompt(PROMPT)
    long_ids = (prompt_ids * (args.prefill // len(prompt_ids) + 1))[: args.prefill]
    pad = tok.bos_token_id if tok.bos_token_id is not None else 0
    # transformers first, on this thread; then sgrt, whose engines free this thread's OpenMP pool.
    for name in hf_paths:
        hf = hf_model(models[name], getattr(torch, name))
        figures[f"{name}_hf_tok_s"] = round(hf_decode_tps(hf, prompt_ids, args.runs, pad), 2)
        if args.prefill:
            figures[f"prefill_{name}_hf_tok_s"] = round(hf_prefill_tps(hf, long_ids, args.runs), 1)
        del hf
    ours = interleaved_medians(models, args.runs, lambda lm: sgrt_decode_tps(lm, prompt_ids))
    prefill = interleaved_medians(models, args.runs, lambda lm: sgrt_prefill_tps(lm, long_ids)) if args.prefill else {}
    for name, tps in prefill.items():
        figures[f"prefill_{name}_sgrt_tok_s"] = round(tps, 1)
        hf_tps = figures.get(f"prefill_{name}_hf_tok_s") or figures.get("prefill_bfloat16_hf_tok_s")
        if hf_tps:
            figures[f"prefill_{name}_ratio"] = round(tps / hf_tps, 3)
    batch_models = {n: m for n, m in models.items() if n in quants or n == "bfloat16"} if args.batch else {}
    batch_tps = interleaved_medians(batch_models, args.runs, lambda lm: sgrt_batch_tps(lm, prompt_ids, args.batch))
    for name in models:
        figures[f"{name}_sgrt_tok_s"] = round(ours[name], 2)
        if name in hf_paths:
            figures[f"{name}_ratio"] = round(ours[name] / figures[f"{name}_hf_tok_s"], 3)
        if name in batch_tps:
            figures[f"batch{args.batch}_{name}_tok_s"] = round(batch_tps[name], 2)
        rows.append([name, figures[f"{name}_weight_mb"], ours[name], figures.get(f"{name}_hf_tok_s", "-"),
                     figures.get(f"{name}_ratio", "-")])
    bf16, hf_bf16 = figures.get("bfloat16_sgrt_tok_s"), figures.get("bfloat16_hf_tok_s")
    for row in rows:
        name = row[0]
        vs_ours = figures[f"{name}_sgrt_tok_s"] / bf16 if bf16 else None
        vs_hf = figures[f"{name}_sgrt_tok_s"] / hf_bf16 if hf_bf16 else None
        if name in quants:
            figures[f"{name}_vs_bfloat16"] = round(vs_ours, 3) if vs_ours else None
            figures[f"{name}_vs_hf_bfloat16"] = round(vs_hf, 3) if vs_hf else None
        row += [vs_ours if vs_ours else "-", vs_hf if vs_hf else "-"]
    for name, tps in batch_tps.items():
        ratio = tps / batch_tps["bfloat16"] if "bfloat16" in batch_tps else None
        if name in quants and ratio:
            figures[f"batch{args.batch}_{name}_vs_bfloat16"] = round(ratio, 3)
        batch_rows.append([name, tps, ratio if ratio else "-"])
    print(f"batch-1 decode, {len(prompt_ids)}-token prompt, {NEW_TOKENS} new tokens, {args.threads} threads, "
          f"median of {args.runs} (int8 / int4: bfloat16 activations)")
    print_table(["weights", "weight MB", "sgrt tok/s", "transformers tok/s (same dtype)", "ratio",
                 "vs sgrt bf16", "vs transformers bf16"], rows)
    if batch_rows:
        print(f"\nbatch {args.batch}: {args.batch} concurrent requests x {NEW_TOKENS} new tokens, output tok/s "
              f"(prefills included), median of {args.runs}")
        print_table(["weights", "sgrt tok/s", "vs sgrt bf16"], batch_rows)
    if prefill:
        print(f"\nprefill: one {args.prefill}-token prompt, prompt tok/s, median of {args.runs} "
              f"(ratio: against transformers in the same dtype; int8 / int4 against its bfloat16)")
        print_table(["weights", "sgrt tok/s", "transformers tok/s", "ratio"],
                    [[n, t, figures.get(f"prefill_{n}_hf_tok_s", "-"), figures.get(f"prefill_{n}_ratio", "-")]
                     for n, t in prefill.items()])
    emit_json("decode", model=args.model, prefill_tokens=args.prefill, threads=args.threads, new_tokens=NEW_TOKENS, runs=args.runs, batch=args.batch, **figures)


if __name__ == "__main__":
    main()
