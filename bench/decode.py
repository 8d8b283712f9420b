"""Batch-1 decode speed: sgrt vs HF transformers ``generate()`` on the same model and prompt.

Same weights (the default model's converted HF folder), a ~60-token prompt, 128 new tokens with
EOS ignored, 2 threads, greedy, median of 3, for float32 and bfloat16. Decode tok/s excludes the
prefill: sgrt reports it per request (tokens after the first / time after the first); for
transformers it is 127 / (time of 128 new tokens - time of 1 new token).

Run: ``python bench/decode.py [--dtypes float32,bfloat16] [--runs 3] [--threads 2]``
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.common import emit_json, median_of, print_table, timed  # noqa: E402

PROMPT = (
    "You are a helpful assistant. Read the following note and continue it in the same style. "
    "The harbour was quiet that morning; the fishing boats had left before dawn and only the "
    "gulls remained, circling the empty quay while the tide came in."
)
NEW_TOKENS = 128


def sgrt_decode_tps(loaded, prompt_ids: list[int], runs: int) -> float:
    from sgrt.engine import Engine, SamplingParams

    engine = Engine(model=loaded, max_total_tokens=1024, enable_radix_cache=False)
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    try:
        engine.generate(prompt_ids, SamplingParams(max_tokens=8, ignore_eos=True))  # warm-up
        return median_of(runs, lambda: engine.generate(prompt_ids, params).output_tok_per_s)
    finally:
        engine.shutdown()


def hf_decode_tps(path: Path, dtype: torch.dtype, prompt_ids: list[int], runs: int) -> float:
    import transformers

    model = transformers.LlamaForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True).eval()
    ids = torch.tensor([prompt_ids])
    kw = dict(do_sample=False, pad_token_id=2)

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
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from sgrt.models import load_model

    rows, figures = [], {}
    for name in args.dtypes.split(","):
        loaded = load_model(args.model, dtype=name)
        prompt_ids = loaded.tokenizer.encode(PROMPT)
        ours = sgrt_decode_tps(loaded, prompt_ids, args.runs)
        theirs = hf_decode_tps(loaded.path, getattr(torch, name), prompt_ids, args.runs)
        rows.append([name, len(prompt_ids), ours, theirs, ours / theirs])
        figures[f"{name}_sgrt_tok_s"] = round(ours, 2)
        figures[f"{name}_hf_tok_s"] = round(theirs, 2)
        figures[f"{name}_ratio"] = round(ours / theirs, 3)
        del loaded
    print(f"batch-1 decode, {NEW_TOKENS} new tokens, {args.threads} threads, median of {args.runs}")
    print_table(["dtype", "prompt tokens", "sgrt tok/s", "transformers tok/s", "ratio"], rows)
    emit_json("decode", threads=args.threads, new_tokens=NEW_TOKENS, runs=args.runs, **figures)


if __name__ == "__main__":
    main()
