"""Fork benchmark: 8 branches from a ~600-token shared context (skeleton-of-thought).

One DSL program writes a shared context (a ~600-token briefing plus the list of points to
expand), forks 8 branches, and each branch expands its point with 48 greedy tokens (EOS
ignored, so every run does the same work). Three ways, same weights, same prompts:

- ``sgrt``: the program on a Runtime with the radix cache on. ``fork`` commits the shared
  prefix once (a prefill-only request); each branch prefills only its own few tokens; the 8
  branches decode as one batch.
- ``sgrt-nocache``: the same program with ``enable_radix_cache=False``: every branch prefills
  the whole context again (the commit request is wasted work too).
- ``hf-generate``: the 8 branch prompts, one after another, through transformers
  ``LlamaForCausalLM.generate()`` loaded from the model's HF folder (``LoadedModel.path``).

Prints wall time, prefill tokens computed, cache hit rate and speedups, then one JSON line.
Target: sgrt >= 2x faster than sgrt-nocache.

Run: ``python bench/fork.py [--branches 8] [--context-tokens 600] [--max-tokens 48]
[--threads 2] [--skip-hf]``
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

import sgrt  # noqa: E402
from bench.common import emit_json, hf_folder, print_table  # noqa: E402

_SUBJECTS = ["The river", "A lighthouse keeper", "The old library", "Every farmer", "The harbour",
             "A travelling merchant", "The mountain village", "The night market"]
_VERBS = ["remembers", "records", "watches", "trades", "repairs", "describes", "collects", "keeps"]
_OBJECTS = ["the spring floods", "letters from distant towns", "the price of grain",
            "broken clocks", "the names of ships", "songs about the sea", "maps of the coast",
            "seeds for the next season"]


def build_context(tokenizer, target_tokens: int) -> str:
    """A deterministic briefing of about ``target_tokens`` tokens (no data files needed)."""
    lines, i = ["Briefing notes about a small coastal region:"], 0
    while len(tokenizer.encode("\n".join(lines))) < target_tokens:
        s, v, o = _SUBJECTS[i % 8], _VERBS[(i * 3) % 8], _OBJECTS[(i * 5) % 8]
        lines.append(f"{i + 1}. {s} {v} {o}, and the people talk about it in year {1900 + 7 * i}.")
        i += 1
    return "\n".join(lines)


@sgrt.function
def skeleton_of_thought(s, context, n, max_tokens):
    s += context + "\n\n"
    s += f"Task: write {n} short paragraphs, one per point below, about life in this region.\n"
    s += "Points: " + ", ".join(f"({i + 1}) {_SUBJECTS[i % 8].lower()}" for i in range(n)) + "\n\n"
    forks = s.fork(n)
    forks += lambda i: f"Paragraph {i + 1}, about {_SUBJECTS[i % 8].lower()}:"
    forks += sgrt.gen("paragraph", max_tokens=max_tokens, ignore_eos=True)
    forks.join()


def run_sgrt(loaded, enable_cache: bool, args, context: str) -> dict:
    rt = sgrt.Runtime(model=loaded, enable_radix_cache=enable_cache, max_total_tokens=16384)
    try:
        # Warm-up on an unrelated prompt (kernels, allocator), then measure from a cold cache.
        rt.generate("Hello there", {"max_tokens": 4, "ignore_eos": True})
        rt.flush_cache()
        before = rt.engine.stats()
        t0 = time.perf_counter()
        state = skeleton_of_thought.run(context=context, n=args.branches,
                                        max_tokens=args.max_tokens, backend=rt)
        paragraphs = state["paragraph"]
        wall = time.perf_counter() - t0
        after = rt.engine.stats()
        prompts = [state.executor.transcript.text + f"Paragraph {i + 1}, about "
                   f"{_SUBJECTS[i % 8].lower()}:" for i in range(args.branches)]
        prompt_tok = after["prompt_tokens"] - before["prompt_tokens"]
        cached = after["cached_tokens"] - before["cached_tokens"]
        metas = state.get_meta_info("paragraph")
        return {
            "wall_s": wall,
            "prefill_tokens": after["prefill_tokens"] - before["prefill_tokens"],
            "prompt_tokens": prompt_tok,
            "cached_tokens": cached,
            "cache_hit_rate": cached / prompt_tok if prompt_tok else 0.0,
            "generated_tokens": sum(m["completion_tokens"] for m in metas),
            "token_ids": [m["output_token_ids"] for m in metas],
            "prompt_ids": [rt.encode(p) for p in prompts],
            "paragraphs": paragraphs,
        }
    finally:
        rt.shutdown()


def run_hf(loaded, prompts_ids: list[list[int]], max_tokens: int) -> dict:
    import transformers

    model = transformers.LlamaForCausalLM.from_pretrained(
        hf_folder(loaded), dtype=torch.float32, local_files_only=True).eval()
    kw = dict(do_sample=False, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
              pad_token_id=2)
    with torch.inference_mode():
        model.generate(torch.tensor([prompts_ids[0][:16]]), **{**kw, "max_new_tokens": 2,
                                                                "min_new_tokens": 2})
        t0 = time.perf_counter()
        outs = []
        for ids in prompts_ids:
            out = model.generate(torch.tensor([ids]), **kw)
            outs.append(out[0, len(ids):].tolist())
        wall = time.perf_counter() - t0
    return {"wall_s": wall, "prefill_tokens": sum(len(p) for p in prompts_ids),
            "prompt_tokens": sum(len(p) for p in prompts_ids), "cached_tokens": 0,
            "cache_hit_rate": 0.0, "generated_tokens": sum(len(o) for o in outs),
            "token_ids": outs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--branches", type=int, default=8)
    ap.add_argument("--context-tokens", type=int, default=600)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--skip-hf", action="store_true", help="skip the transformers baseline")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from sgrt.models import load_model

    loaded = load_model("smollm2-135m-instruct", dtype="float32", device="cpu")
    context = build_context(loaded.tokenizer, args.context_tokens)
    context_tokens = len(loaded.tokenizer.encode(context))

    results = {"sgrt": run_sgrt(loaded, True, args, context),
               "sgrt-nocache": run_sgrt(loaded, False, args, context)}
    prompts_ids = results["sgrt"]["prompt_ids"]
    if not args.skip_hf:
        results["hf-generate"] = run_hf(loaded, prompts_ids, args.max_tokens)

    base = results["sgrt"]["wall_s"]
    rows = []
    for name, r in results.items():
        rows.append([name, r["wall_s"], r["prefill_tokens"], r["prompt_tokens"],
                     r["cached_tokens"], r["cache_hit_rate"], r["generated_tokens"],
                     r["wall_s"] / base])
    print(f"fork: {args.branches} branches x {args.max_tokens} tokens from a "
          f"{context_tokens}-token context, float32, {args.threads} threads")
    print_table(["config", "wall s", "prefill tok", "prompt tok", "cached tok", "hit rate",
                 "generated", "x slower than sgrt"], rows)
    same_as_nocache = sum(a == b for a, b in zip(results["sgrt"]["token_ids"],
                                                  results["sgrt-nocache"]["token_ids"]))
    figures = {
        "branches": args.branches, "context_tokens": context_tokens,
        "max_tokens": args.max_tokens, "threads": args.threads,
        "speedup_vs_nocache": results["sgrt-nocache"]["wall_s"] / base,
        "branches_identical_to_nocache": same_as_nocache,
    }
    for name, r in results.items():
        key = name.replace("-", "_")
        for k in ("wall_s", "prefill_tokens", "prompt_tokens", "cached_tokens", "cache_hit_rate",
                  "generated_tokens"):
            figures[f"{key}_{k}"] = r[k]
    if "hf-generate" in results:
        figures["speedup_vs_hf"] = results["hf-generate"]["wall_s"] / base
        figures["branches_identical_to_hf"] = sum(
            a == b for a, b in zip(results["sgrt"]["token_ids"], results["hf-generate"]["token_ids"]))
    print(f"sgrt vs radix cache disabled: {figures['speedup_vs_nocache']:.2f}x (target >= 2x)")
    emit_json("fork", **figures)


if __name__ == "__main__":
    main()
