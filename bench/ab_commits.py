"""A/B of two commits of sgrt: float32 greedy outputs token-identical, and benchmark ratios.

The base commit is exported with ``git archive`` into a temporary folder; each side runs in its
own process with its own tree first on ``sys.path``.

* ``tokens``: a fixed set of float32 greedy requests drawn from the ``bench/`` workloads
  (throughput's chat prompts in one continuous batch; speculative's copy / extract / chat
  prompts with and without n-gram speculation, alone and batched; JSON Schema outputs with
  exact and text jump-forward; stop strings, prompt log-probabilities, a prefill-only request;
  a small KV pool that forces retraction) run through both commits; every request's token ids,
  finish reason, matched stop, text and draft / forced-token counts must be equal.
* ``bench``: ``bench/decode.py``, ``bench/throughput.py`` and ``bench/speculative.py`` of each
  commit, short runs, alternating base / new ``--rounds`` times; the ratio new / base of each
  sgrt figure, median over rounds.

Run: ``python bench/ab_commits.py --base c7be7a9 [--what tokens,bench] [--groups json,retract]
[--benches decode,speculative] [--rounds 1] [--runs N]``
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def export_tree(rev: str, into: Path) -> Path:
    """The files of commit ``rev`` under ``into``."""
    into.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


# -- tokens --------------------------------------------------------------------------------------
def token_workloads(tokenizer) -> list[tuple[str, dict, list[tuple[str, dict]]]]:
    """``(engine options, [(prompt, sampling params)])`` groups; each group is one batch."""
    sys.path.insert(1, str(ROOT))
    from bench.speculative import chat_prompt, copy_prompt, extract_prompt
    from bench.throughput import make_workload

    def chat(text: str) -> str:
        return tokenizer.apply_chat_template([{"role": "user", "content": text}])

    groups = []
    work = [(p, min(m, 24)) for p, m in make_workload(tokenizer, 4, 0)][:4]
    groups.append(("throughput", dict(max_running_requests=3, chunked_prefill_size=128),
                   [(p, dict(max_tokens=m)) for p, m in work]))
    spec_prompts = [make(tokenizer, random.Random(1)) for make in (copy_prompt, extract_prompt, chat_prompt)]
    for spec in (None, "ngram"):
        groups.append((f"speculative-{spec}-alone", dict(enable_radix_cache=False),
                       [(spec_prompts[0], dict(max_tokens=40, speculative=spec))]))
        groups.append((f"speculative-{spec}-batch", dict(),
                       [(p, dict(max_tokens=20, speculative=spec, return_logprob=True, top_logprobs_num=2))
                        for p in spec_prompts]))
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                                "age": {"type": "integer"},
                                                "city": {"enum": ["Paris", "Berlin", "Rome"]}},
              "required": ["name", "age", "city"], "additionalProperties": False}
    json_prompt = chat("Describe a person as JSON with name, age and city.")
    groups.append(("json", dict(speculative="ngram"), [
        (json_prompt, dict(max_tokens=40, json_schema=schema)),
        (json_prompt, dict(max_tokens=40, json_schema=schema, jump_forward="text")),
        (json_prompt, dict(max_tokens=24, regex=r"(yes|no), because [a-z ]{5,30}\.")),
    ]))
    groups.append(("misc", dict(), [
        (chat("Count from one to twenty in words."), dict(max_tokens=32, stop=[" ten", "eleven"])),
        (chat("Name three colours."), dict(max_tokens=24, min_tokens=4, stop_token_ids=[11])),
        ("The capital of France is Paris. The capital of Italy is", dict(max_tokens=0, return_logprob=True,
                                                                          logprob_start_len=3)),
        (chat("Write a limerick about a fox."), dict(max_tokens=12, return_logprob=True, logprob_start_len=0,
                                                     top_logprobs_num=3)),
    ]))
    small = [(chat(f"Write a long story about {t}."), dict(max_tokens=24, ignore_eos=True))
             for t in ("a river", "a mountain", "a lighthouse")]
    groups.append(("retract", dict(max_total_tokens=120, chunked_prefill_size=32), small))
    return groups


def run_tokens(out: str, only: list[str] | None = None) -> None:
    """Child: run every group (or those named in ``only``) through this process's sgrt; write
    the outcomes as JSON."""
    import torch

    torch.set_num_threads(2)
    from sgrt.engine import Engine, SamplingParams
    from sgrt.models import load_model

    loaded = load_model("smollm2-135m-instruct", dtype="float32")
    results = {}
    for name, options, reqs in token_workloads(loaded.tokenizer):
        if only and name not in only:
            continue
        engine = Engine(model=loaded, **{"max_total_tokens": 8192, **options})
        try:
            handles = [engine.submit(p, SamplingParams(**params)) for p, params in reqs]
            rs = [h.result() for h in handles]
        finally:
            engine.shutdown()
        results[name] = [dict(tokens=r.token_ids, finish=r.finish_reason, matched=r.matched, text=r.text,
                              drafted=r.spec_drafted, accepted=r.spec_accepted, forced=r.forced_tokens,
                              error=r.error,
                              prompt_logprobs=None if r.prompt_logprobs is None
                              else [None if x is None else round(x, 4) for x in r.prompt_logprobs])
                         for r in rs]
        print(os.path.basename(os.environ.get("PYTHONPATH", "")), name, "done", flush=True)
    Path(out).write_text(json.dumps(results))


def compare_tokens(base: Path, new: Path, groups: str = "") -> dict:
    # Both sides at once: outputs do not depend on timing, and the wall time halves.
    procs, outs = {}, {}
    for side, tree in (("base", base), ("new", new)):
        outs[side] = tempfile.mktemp(suffix=".json")
        env = {**os.environ, "PYTHONPATH": str(tree)}
        procs[side] = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--child-tokens", outs[side],
                                        "--tree", str(tree), "--groups", groups], env=env, cwd=str(tree))
    outcomes = {}
    for side, proc in procs.items():
        if proc.wait() != 0:
            raise RuntimeError(f"the {side} side failed (exit status {proc.returncode})")
        outcomes[side] = json.loads(Path(outs[side]).read_text())
    mismatches = []
    n = 0
    for group, rows in outcomes["base"].items():
        for i, (a, b) in enumerate(zip(rows, outcomes["new"][group])):
            n += 1
            if a != b:
                diff = {k: (a[k], b[k]) for k in a if a[k] != b[k]}
                mismatches.append(f"{group}[{i}]: {diff}")
    for m in mismatches:
        print("MISMATCH", m)
    print(f"tokens: {n - len(mismatches)} of {n} requests identical")
    return dict(requests=n, identical=n - len(mismatches))


# -- bench ---------------------------------------------------------------------------------------
BENCHES = {
    "decode": ["bench/decode.py", "--dtypes", "float32", "--quantizations", "", "--batch", "0", "--runs", "3"],
    "throughput": ["bench/throughput.py", "--requests", "8", "--concurrency", "4"],
    "speculative": ["bench/speculative.py", "--runs", "1", "--tokens", "48", "--concurrency", "4"],
}
SGRT_FIGURES = {
    "decode": ["float32_sgrt_tok_s"],
    "throughput": ["sgrt_tok_s"],
    "speculative": ["copy_b1_spec_tok_s", "copy_b1_base_tok_s", "chat_b1_spec_tok_s", "chat_b1_base_tok_s",
                    "copy_c4_spec_tok_s", "copy_c4_base_tok_s"],
}


def run_bench(tree: Path, name: str, runs: int | None = None) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    argv = list(BENCHES[name])
    if runs is not None and "--runs" in argv:
        argv[argv.index("--runs") + 1] = str(runs)
    proc = subprocess.run([sys.executable, *argv], cwd=str(tree), env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{name} in {tree} failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def compare_bench(base: Path, new: Path, rounds: int, names: list[str], runs: int | None = None) -> dict:
    ratios: dict[str, list[float]] = {}
    for k in range(rounds):
        for name in names:
            # ABBA order: the side that runs second in a pair is not always the same one.
            if k % 2 == 0:
                a = run_bench(base, name, runs)
                b = run_bench(new, name, runs)
            else:
                b = run_bench(new, name, runs)
                a = run_bench(base, name, runs)
            for key in SGRT_FIGURES[name]:
                if key in a and key in b and a[key]:
                    ratios.setdefault(f"{name}.{key}", []).append(b[key] / a[key])
                    print(f"{name}.{key}: base {a[key]} new {b[key]} ratio {b[key] / a[key]:.3f}", flush=True)
    return {k: round(statistics.median(v), 3) for k, v in ratios.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", default="c7be7a9", help="the commit to compare against")
    ap.add_argument("--what", default="tokens,bench")
    ap.add_argument("--benches", default="decode,throughput,speculative")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--runs", type=int, default=None, help="override the benches' --runs")
    ap.add_argument("--groups", default="", help="token groups to run (comma list; default all)")
    ap.add_argument("--child-tokens", help=argparse.SUPPRESS)
    ap.add_argument("--tree", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child_tokens:
        sys.path.insert(0, args.tree)
        run_tokens(args.child_tokens, [g for g in args.groups.split(",") if g])
        return
    figures: dict = {"base": args.base}
    with tempfile.TemporaryDirectory(prefix="sgrt-ab-") as tmp:
        base = export_tree(args.base, Path(tmp) / "base")
        what = args.what.split(",")
        if "tokens" in what:
            figures["tokens"] = compare_tokens(base, ROOT, args.groups)
        if "bench" in what:
            figures["ratios"] = compare_bench(base, ROOT, args.rounds, [b for b in args.benches.split(",") if b],
                                             args.runs)
    sys.path.insert(0, str(ROOT))
    from bench.common import emit_json

    emit_json("ab_commits", **figures)


if __name__ == "__main__":
    main()
