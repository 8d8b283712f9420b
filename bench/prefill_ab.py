"""Prefill tok/s on 1 thread: this tree against a base commit, and llama.cpp, each in its own
process (issue 21's "prefill >= 3x llama.cpp").

For each model (default: the default model's Q4_1 GGUF and Gemma 3 270M's Q4_K_M GGUF, sgrt in
int4) and prompt length (``--tokens``, default 256 and 1,024), one prefill forward of that many
tokens in one chunk, as the model runner does it (the layers over a fresh KV pool, then the LM
head on the last row only), timed in the calling thread's CPU time (``time.thread_time``), so
that other processes on a shared machine do not count; median of ``--runs``. llama.cpp
(``xllamacpp``, the ``bench`` extra) prefills the same token ids with the same thread count in a
process that never imports torch (torch's libgomp in the same process slows both), timed in
process CPU time. Rounds alternate base / new / new / base, llama.cpp between, so that the
machine's drift lands on all sides alike.

The base commit is exported with ``git archive`` (``bench/ab_commits.py``); each sgrt side runs
with its own tree first on ``sys.path`` (native kernels compile per source, cached).

Run: ``python bench/prefill_ab.py --base d2d78ac [--models smollm2-135m-instruct,gemma3-270m-q4-k-m]
[--tokens 256,1024] [--rounds 2] [--runs 3] [--threads 1] [--no-llamacpp]``
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def child_sgrt(tree: str, models: list[str], tokens: list[int], runs: int, threads: int, ids_file: str) -> dict:
    """In a child process: sgrt (of ``tree``) prefill tok/s per ``model@tokens``."""
    sys.path.insert(0, tree)
    import torch

    torch.set_num_threads(threads)
    from sgrt.engine.attention import PagedAttention, RowSpec
    from sgrt.engine.kv_pool import KVPool
    from sgrt.models import load_model

    ids_by_model = json.loads(Path(ids_file).read_text())
    out = {}
    for spec in models:
        model = load_model(spec, dtype="bfloat16", quantization="int4").model
        cfg = model.config
        for n in tokens:
            ids = torch.tensor(ids_by_model[spec]["ids"][:n])
            pool = KVPool(n + 8, cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, torch.bfloat16, "cpu")

            def prefill() -> float:
                start = time.thread_time()
                attn = PagedAttention(pool, [RowSpec(list(range(1, n + 1)), n)], native=model.native_ops)
                with torch.inference_mode():
                    model.compute_logits(model(ids, torch.arange(n), attn)[-1:])
                return n / (time.thread_time() - start)

            prefill()  # warm-up
            out[f"{spec}@{n}"] = statistics.median(prefill() for _ in range(runs))
        del model
    return out


def child_llamacpp(models: list[str], tokens: list[int], runs: int, threads: int, ids_file: str) -> dict:
    """In a child process that never imports torch: llama.cpp prefill tok/s per ``model@tokens``."""
    import xllamacpp

    ids_by_model = json.loads(Path(ids_file).read_text())
    out = {}
    for spec in models:
        for n in tokens:
            params = xllamacpp.CommonParams()
            params.model.path = ids_by_model[spec]["path"]
            params.n_ctx, params.n_batch, params.n_ubatch, params.n_parallel = n + 64, n, n, 1
            params.cpuparams.n_threads = params.cpuparams_batch.n_threads = threads
            params.verbosity = -1
            server = xllamacpp.Server(params)
            ids = ids_by_model[spec]["ids"][:n]
            request = {"prompt": ids, "n_predict": 1, "temperature": 0.0, "top_k": 1, "cache_prompt": False,
                       "stream": False}
            server.handle_completions({**request, "prompt": ids[:64]})  # warm-up

            def prefill() -> float:
                start = time.process_time()
                timings = server.handle_completions(request).get("timings")
                if timings is None:
                    raise RuntimeError("llama.cpp answered without timings")
                return n / (time.process_time() - start)

            out[f"{spec}@{n}"] = statistics.median(prefill() for _ in range(runs))
            del server
    return out


def _run_child(argv: list[str]) -> dict:
    proc = subprocess.run([sys.executable, __file__, *argv], capture_output=True, text=True, cwd=ROOT)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"child {argv[:2]} failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return json.loads(lines[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", default="d2d78ac", help="the commit to compare against")
    ap.add_argument("--models", default="smollm2-135m-instruct,gemma3-270m-q4-k-m")
    ap.add_argument("--tokens", default="256,1024")
    ap.add_argument("--rounds", type=int, default=2, help="base / new / new / base rounds")
    ap.add_argument("--runs", type=int, default=3, help="prefills per side per process (median)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-llamacpp", action="store_true")
    ap.add_argument("--child", choices=["sgrt", "llamacpp"], help=argparse.SUPPRESS)
    ap.add_argument("--tree", help=argparse.SUPPRESS)
    ap.add_argument("--ids", help=argparse.SUPPRESS)
    args = ap.parse_args()
    models = [m for m in args.models.split(",") if m]
    tokens = [int(t) for t in args.tokens.split(",") if t]
    if args.child == "sgrt":
        print(json.dumps(child_sgrt(args.tree, models, tokens, args.runs, args.threads, args.ids)))
        return
    if args.child == "llamacpp":
        print(json.dumps(child_llamacpp(models, tokens, args.runs, args.threads, args.ids)))
        return

    sys.path.insert(0, str(ROOT))
    from bench.ab_commits import export_tree
    from bench.common import emit_json, print_table
    from bench.decode import PROMPT
    from sgrt.models.loader import load_tokenizer
    from sgrt.models.specs import resolve_spec

    llama = not args.no_llamacpp
    if llama:
        try:
            __import__("xllamacpp")
        except ImportError:
            print("xllamacpp is not installed (pip install -e '.[bench]'): sgrt rows only")
            llama = False
    print(f"load average at start: {os.getloadavg()[0]:.2f} (1 min); {args.threads} thread(s)")
    with tempfile.TemporaryDirectory(prefix="sgrt-prefill-ab-") as tmp:
        base_tree = export_tree(args.base, Path(tmp) / "base")
        ids = {}
        for spec in models:
            prompt = load_tokenizer(spec).encode_prompt(PROMPT)
            ids[spec] = {"path": str(resolve_spec(spec)[1]),
                         "ids": (prompt * (max(tokens) // len(prompt) + 1))[: max(tokens)]}
        ids_file = Path(tmp) / "ids.json"
        ids_file.write_text(json.dumps(ids))
        common = ["--models", args.models, "--tokens", args.tokens, "--runs", str(args.runs),
                  "--threads", str(args.threads), "--ids", str(ids_file)]
        sides: dict[str, list[dict]] = {"base": [], "new": [], "llama.cpp": []}
        for _ in range(args.rounds):
            for side in ("base", "new", "new", "base"):
                tree = str(base_tree if side == "base" else ROOT)
                sides[side].append(_run_child(["--child", "sgrt", "--tree", tree, *common]))
                if llama and side == "new" and len(sides["new"]) % 2 == 1:
                    sides["llama.cpp"].append(_run_child(["--child", "llamacpp", *common]))
    rows, figures = [], {}
    for key in sides["new"][0]:
        med = {side: statistics.median(r[key] for r in runs) for side, runs in sides.items() if runs}
        row = [key, round(med["base"], 1), round(med["new"], 1), f"{med['new'] / med['base']:.2f}"]
        name = key.replace("-", "_").replace("@", "_")
        figures[f"{name}_base_tok_s"] = round(med["base"], 1)
        figures[f"{name}_new_tok_s"] = round(med["new"], 1)
        if "llama.cpp" in med:
            row += [round(med["llama.cpp"], 1), f"{med['base'] / med['llama.cpp']:.2f}",
                    f"{med['new'] / med['llama.cpp']:.2f}"]
            figures[f"{name}_llamacpp_tok_s"] = round(med["llama.cpp"], 1)
            figures[f"{name}_new_over_llamacpp"] = round(med["new"] / med["llama.cpp"], 3)
        rows.append(row)
    headers = ["model@tokens", "base tok/s", "new tok/s", "new/base", "llama.cpp tok/s", "base/llama.cpp",
               "new/llama.cpp"]
    print_table(headers[: len(rows[0])], rows)
    print(f"load average at end: {os.getloadavg()[0]:.2f} (1 min)")
    emit_json("prefill_ab", base=args.base, threads=args.threads, rounds=args.rounds, runs=args.runs, **figures)


if __name__ == "__main__":
    main()
