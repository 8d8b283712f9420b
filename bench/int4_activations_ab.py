"""The ``int4_activations`` policies against each other in one process: prefill tok/s (one request
of ``--prefill`` tokens in one chunk, TTFT, through the engine) and batch-1 decode tok/s, per model,
every policy loaded once and the policies alternated A B C / C B A per round, so that a shared
machine's drift lands on all alike (docs/DESIGN.md, "int8 activations"; issue 21).

Prints per model and policy the median tok/s and the median per-round ratio to ``int16`` (the
default), the load average at start and end, and one line of JSON. llama.cpp's own figures come
from ``bench/vs_llamacpp.py --int4-activations-rows int8,int8-prefill``.

Run: ``python bench/int4_activations_ab.py [--models smollm2-135m-instruct,gemma3-270m-q4-k-m]
[--policies int16,int8,int8-prefill] [--prefill 256,1024] [--rounds 2] [--threads 2] [--no-decode]``
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.common import emit_json, print_table  # noqa: E402
from bench.decode import PROMPT, sgrt_decode_tps, sgrt_prefill_tps  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="smollm2-135m-instruct,gemma3-270m-q4-k-m")
    ap.add_argument("--policies", default="int16,int8,int8-prefill")
    ap.add_argument("--prefill", default="256,1024", help="prompt lengths, one chunk each")
    ap.add_argument("--rounds", type=int, default=2, help="A B C / C B A rounds")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-decode", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from sgrt.models import load_model

    policies = [p for p in args.policies.split(",") if p]
    if policies[0] != "int16":
        raise SystemExit("--policies must start with int16 (the ratios' baseline)")
    lengths = [int(n) for n in args.prefill.split(",") if n]
    load_start = os.getloadavg()[0]
    print(f"load average at start: {load_start:.2f} (1 min); {args.threads} thread(s)")
    figures: dict = {}
    rows = []
    for spec in [m for m in args.models.split(",") if m]:
        models = {p: load_model(spec, dtype="bfloat16", quantization="int4", int4_activations=p) for p in policies}
        prompt = models["int16"].tokenizer.encode_prompt(PROMPT)
        tasks = {f"prefill {n}": (sgrt_prefill_tps, (prompt * (n // len(prompt) + 1))[:n]) for n in lengths}
        if not args.no_decode:
            tasks["decode"] = (sgrt_decode_tps, prompt)
        got = {(t, p): [] for t in tasks for p in policies}
        for r in range(2 * args.rounds):
            order = policies if r % 2 == 0 else policies[::-1]
            for task, (fn, ids) in tasks.items():
                for p in order:
                    got[task, p].append(fn(models[p], ids))
                    print(f"  {spec} round {r} {task} {p}: {got[task, p][-1]:.1f} tok/s", flush=True)
        key = spec.replace("-", "_")
        for task in tasks:
            base = got[task, "int16"]
            for p in policies:
                med = statistics.median(got[task, p])
                ratios = [a / b for a, b in zip(got[task, p], base)]
                name = f"{key}_{task.replace(' ', '')}_{p.replace('-', '_')}"
                figures[f"{name}_tok_s"] = round(med, 1)
                figures[f"{name}_over_int16"] = round(statistics.median(ratios), 3)
                rows.append([spec, task, p, round(med, 1),
                             f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})"])
        del models
    print_table(["model", "task", "int4_activations", "tok/s (median)", "/ int16 per round (min-max)"], rows)
    load_end = os.getloadavg()[0]
    print(f"load average at end: {load_end:.2f} (1 min)")
    emit_json("int4_activations_ab", threads=args.threads, rounds=args.rounds, load_start=round(load_start, 2),
              load_end=round(load_end, 2), **figures)


if __name__ == "__main__":
    main()
