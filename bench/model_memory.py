"""Models at the sizes agents run: peak memory, load time, cache bytes and batch-1 decode of sgrt
beside llama.cpp on the same GGUF (issue 38).

Builds random-weight files once under ``<cache root>/bench/model_files`` (:mod:`bench.model_files`):

- ``llama-1b``: the issue's 1B shape (16 layers, hidden 2048, ffn 5632, 16 / 4 heads), Q4_1
  projections, Q8_0 tied embedding (0.56 GB);
- ``qwen2-1.5b``: Qwen2.5 1.5B's shape (q / k / v biases) in a Q4_K_M-like mix (Q4_K, Q6_K
  ``ffn_down`` / ``attn_v`` every other layer);
- ``llama-8b``: Llama 3.1 8B's shape, untied, the same Q4_K_M-like mix (4.5 GB);
- ``hf-llama-1b``: the ``llama-1b`` shape as a bfloat16 HF folder (its decode is compared with
  llama.cpp's on the ``llama-1b`` GGUF).

Each load runs in a fresh process, int4 (bfloat16 activations), ``--threads`` threads, a KV pool /
context of ``--ctx`` tokens: sgrt cold (its cache entry for the file deleted first: the file's
metadata read, the weights packed), sgrt warm (the store mapped), and llama.cpp (``xllamacpp``,
which maps the GGUF), alternated. Load time is wall time from the process's start to a model
ready to decode (both import their runtime: torch for sgrt); peak RSS is the process's VmHWM after
decoding (mapped weight pages count: llama.cpp's and sgrt's alike); decode is tok/s of
``--tokens`` greedy tokens after a short prompt (sgrt through its Engine, from the result's
timings: ``(tokens - 1) / (total - TTFT)``; llama.cpp its own ``predicted_per_second``). The files
sit in the page cache for every run (both engines alike).

Targets (issue 38): peak RSS <= 1.5x the file plus the KV pool, cold and warm; cache <= 1.2x the
file; warm load <= 2x llama.cpp's, cold <= 5x; decode >= 1.5x llama.cpp's; the 8B file loads and
decodes here. Run on a quiet machine:

    python bench/model_memory.py [--models llama-1b,qwen2-1.5b,hf-llama-1b,llama-8b] [--rounds 2]

``--base DIR`` (a checkout of another commit, e.g. ``git worktree add DIR <rev>``) alternates that
sgrt's cold and warm loads with this one's, each cold load after deleting the entry, and prints
both: a before / after in one invocation, with each load's CPU seconds (the process's and its
children's user + system time to ready: less moved than wall time by other work on the machine).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import emit_json, print_table  # noqa: E402
from bench.model_files import Q4_1_FILE, Q4_K_M, SHAPES, Shape, write_gguf, write_hf_folder  # noqa: E402

ISSUE_1B = Shape("llama", 16, 2048, 5632, 16, 4, context=131072)
MODELS = {  # name -> (shape, GGML types or None for an HF folder, the GGUF llama.cpp runs beside it)
    "llama-1b": (ISSUE_1B, Q4_1_FILE, "llama-1b"),
    "qwen2-1.5b": (SHAPES["qwen2-1.5b"], Q4_K_M, "qwen2-1.5b"),
    "hf-llama-1b": (ISSUE_1B, None, "llama-1b"),
    "llama-8b": (SHAPES["llama-8b"], Q4_K_M, "llama-8b"),
}
PROMPT = "The history of the lighthouse on the northern cape begins in"

_SGRT_CHILD = r"""
import json, sys, time
t0 = float(sys.argv[1])
import torch
from sgrt.engine import Engine, SamplingParams
def status(key):
    fields = dict(l.split(":", 1) for l in open("/proc/self/status").read().splitlines() if ":" in l)
    return int(fields[key].split()[0]) * 1024
torch.set_num_threads(int(sys.argv[4]))
eng = Engine(model=sys.argv[2], dtype="bfloat16", quantization="int4", max_total_tokens=int(sys.argv[3]))
lm = eng.loaded
ready = time.time() - t0
import resource
cpu = sum(getattr(resource.getrusage(w), f) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
          for f in ("ru_utime", "ru_stime"))
rates = []
for _ in range(2):
    r = eng.generate(sys.argv[5], SamplingParams(max_tokens=int(sys.argv[6]), temperature=0, ignore_eos=True))
    rates.append((r.completion_tokens - 1) / (r.total_time - r.ttft))
print(json.dumps({"load_s": ready, "load_cpu_s": cpu, "peak": status("VmHWM"), "decode": max(rates), "converted": lm.converted,
                  "weights": lm.weight_bytes, "kv": eng.pool.k.numel() * eng.pool.k.element_size() * 2,
                  "store": str(lm.path), "describe": eng.describe()}))
eng.shutdown()
"""


def files_root() -> Path:
    from sgrt.paths import cache_root

    return cache_root() / "bench" / "model_files"


def ensure_file(name: str) -> Path:
    """The model file (or folder) ``name``, written first if absent."""
    shape, types, _ = MODELS[name]
    root = files_root()
    root.mkdir(parents=True, exist_ok=True)
    if types is None:
        path = root / name
        if not (path / "config.json").is_file():
            print(f"[bench] writing {path} ...", file=sys.stderr)
            write_hf_folder(path, shape)
        return path
    path = root / f"{name}.gguf"
    if not path.is_file():
        print(f"[bench] writing {path} ...", file=sys.stderr)
        tmp = path.with_suffix(".tmp")
        write_gguf(tmp, shape, types)
        tmp.rename(path)
    return path


def file_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.glob("*.safetensors")) if path.is_dir() else path.stat().st_size


def tree_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def sgrt_run(path: Path, args: argparse.Namespace, root: Path | None = None) -> dict:
    """One load and decode of ``path`` in a fresh process, of the sgrt in ``root`` (default this
    checkout's), its bytecode compiled first (as an install leaves it: ``make install``, pip)."""
    root = root or Path(__file__).resolve().parent.parent
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(root / "sgrt")], check=True, capture_output=True)
    env = dict(os.environ, PYTHONPATH=str(root))
    cmd = [sys.executable, "-c", _SGRT_CHILD, str(time.time()), str(path), str(args.ctx), str(args.threads),
           PROMPT, str(args.tokens)]
    # (run in the root: ``python -c`` puts the working folder before PYTHONPATH)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600, cwd=root)
    if proc.returncode != 0:
        raise RuntimeError(f"sgrt on {path}: {proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def llamacpp_run(path: Path, args: argparse.Namespace, prompt_ids: list[int]) -> dict:
    from bench.llamacpp_process import LlamaCppProcess

    t0 = time.time()
    with LlamaCppProcess(str(path), args.threads, args.ctx, 512) as proc:
        ready = time.time() - t0
        rates = [proc.decode_tps(prompt_ids, args.tokens) for _ in range(2)]
        fields = dict(line.split(":", 1) for line in Path(f"/proc/{proc.pid}/status").read_text().splitlines()
                      if ":" in line)
        peak = int(fields["VmHWM"].split()[0]) * 1024
    return {"load_s": ready, "peak": peak, "decode": max(rates)}


def sgrt_entry(path: Path) -> Path:
    """The cache folder sgrt keeps for ``path`` (a GGUF's entry; an HF folder's stores)."""
    from sgrt.models.gguf_convert import gguf_entry
    from sgrt.paths import cache_root

    if path.is_dir():
        matches = sorted((cache_root() / "hf").glob(f"{path.name}-*"))
        return matches[-1] if matches else cache_root() / "hf" / f"{path.name}-missing"
    return gguf_entry(path)


def _delete_entry(path: Path) -> None:
    """Delete sgrt's cache entry of ``path`` (a cold load next)."""
    entry = sgrt_entry(path)
    if entry.exists():
        shutil.rmtree(entry)


def measure(name: str, args: argparse.Namespace) -> dict:
    from sgrt.models import load_tokenizer

    path = ensure_file(name)
    gguf = ensure_file(MODELS[name][2])
    size = file_bytes(path)
    prompt_ids = load_tokenizer(str(gguf)).encode(PROMPT)
    _delete_entry(path)
    runs = {"sgrt_cold": [], "sgrt_warm": [], "llamacpp": [], "base_cold": [], "base_warm": []}
    for r in range(args.rounds):
        if not args.skip_llamacpp:
            runs["llamacpp"].append(llamacpp_run(gguf, args, prompt_ids))
        if args.base is not None:  # (the base commit's sgrt, alternated with this one's on the same cache)
            if r == 0:
                _delete_entry(path)
                runs["base_cold"].append(sgrt_run(path, args, args.base))
            runs["base_warm"].append(sgrt_run(path, args, args.base))
        if r == 0:
            _delete_entry(path)
            runs["sgrt_cold"].append(sgrt_run(path, args))
            entry = sgrt_entry(path)
        runs["sgrt_warm"].append(sgrt_run(path, args))
    cold, warm = runs["sgrt_cold"][0], runs["sgrt_warm"]
    kv = cold["kv"]
    store = tree_bytes(Path(cold["store"]))
    row = {
        "model": name, "file_gb": size / 1e9, "kv_gb": kv / 1e9,
        "peak_cold_gb": cold["peak"] / 1e9, "peak_warm_gb": max(w["peak"] for w in warm) / 1e9,
        "bound_gb": (1.5 * size + kv) / 1e9,
        "load_cold_s": cold["load_s"], "load_warm_s": statistics.median(w["load_s"] for w in warm),
        "load_cold_cpu_s": cold["load_cpu_s"], "load_warm_cpu_s": statistics.median(w["load_cpu_s"] for w in warm),
        "cache_gb": tree_bytes(entry) / 1e9, "store_gb": store / 1e9,
        "decode": statistics.median(w["decode"] for w in warm),
        "describe": cold["describe"],
    }
    if runs["base_cold"]:
        row.update({"base_load_cold_s": runs["base_cold"][0]["load_s"],
                    "base_load_warm_s": statistics.median(w["load_s"] for w in runs["base_warm"]),
                    "base_peak_cold_gb": runs["base_cold"][0]["peak"] / 1e9,
                    "base_peak_warm_gb": max(w["peak"] for w in runs["base_warm"]) / 1e9,
                    "base_load_cold_cpu_s": runs["base_cold"][0]["load_cpu_s"],
                    "base_load_warm_cpu_s": statistics.median(w["load_cpu_s"] for w in runs["base_warm"]),
                    "loads_s": {k: [round(x["load_s"], 2) for x in v] for k, v in runs.items() if k != "llamacpp"}})
    if runs["llamacpp"]:
        ll = runs["llamacpp"]
        row.update({"llamacpp_peak_gb": max(x["peak"] for x in ll) / 1e9,
                    "llamacpp_load_s": statistics.median(x["load_s"] for x in ll),
                    "llamacpp_decode": statistics.median(x["decode"] for x in ll)})
        row.update({"warm_load_x": row["load_warm_s"] / row["llamacpp_load_s"],
                    "cold_load_x": row["load_cold_s"] / row["llamacpp_load_s"],
                    "decode_x": row["decode"] / row["llamacpp_decode"]})
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="llama-1b,qwen2-1.5b,hf-llama-1b,llama-8b")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=4096, help="KV pool tokens (sgrt) / context (llama.cpp)")
    ap.add_argument("--tokens", type=int, default=64, help="greedy tokens a decode run")
    ap.add_argument("--rounds", type=int, default=2, help="warm sgrt / llama.cpp runs a model, alternated")
    ap.add_argument("--skip-llamacpp", action="store_true")
    ap.add_argument("--base", type=Path, default=None,
                    help="another checkout (a worktree of the base commit): its sgrt's cold and warm loads "
                         "alternate with this one's, on the same files and cache")
    args = ap.parse_args()
    rows = []
    for name in args.models.split(","):
        row = measure(name, args)
        rows.append(row)
        print(f"[bench] {name}: {row['describe']}", file=sys.stderr)
    headers = ["model", "file GB", "peak cold / warm GB (x file)", "<= 1.5x + KV", "llama.cpp peak",
               "load cold / warm s", "llama.cpp load s", "cache GB (x file)", "decode tok/s", "llama.cpp tok/s",
               "decode x"]
    table = []
    for r in rows:
        f = r["file_gb"]
        table.append([
            r["model"], f"{f:.2f}",
            f"{r['peak_cold_gb']:.2f} / {r['peak_warm_gb']:.2f} ({r['peak_cold_gb'] / f:.2f}x / {r['peak_warm_gb'] / f:.2f}x)",
            f"{r['bound_gb']:.2f} {'yes' if max(r['peak_cold_gb'], r['peak_warm_gb']) <= r['bound_gb'] else 'NO'}",
            f"{r.get('llamacpp_peak_gb', 0):.2f} ({r.get('llamacpp_peak_gb', 0) / f:.2f}x)",
            f"{r['load_cold_s']:.1f} / {r['load_warm_s']:.1f} ({r.get('cold_load_x', 0):.1f}x / {r.get('warm_load_x', 0):.2f}x)",
            f"{r.get('llamacpp_load_s', 0):.1f}",
            f"{r['cache_gb']:.2f} ({r['cache_gb'] / f:.2f}x)",
            f"{r['decode']:.1f}", f"{r.get('llamacpp_decode', 0):.1f}", f"{r.get('decode_x', 0):.2f}",
        ])
    print_table(headers, table)
    if args.base is not None:
        print_table(["model", "base load cold / warm s", "load cold / warm s", "base CPU s cold / warm",
                     "CPU s cold / warm", "base peak cold / warm GB", "peak cold / warm GB"],
                    [[r["model"], f"{r['base_load_cold_s']:.1f} / {r['base_load_warm_s']:.2f}",
                      f"{r['load_cold_s']:.1f} / {r['load_warm_s']:.2f}",
                      f"{r['base_load_cold_cpu_s']:.1f} / {r['base_load_warm_cpu_s']:.2f}",
                      f"{r['load_cold_cpu_s']:.1f} / {r['load_warm_cpu_s']:.2f}",
                      f"{r['base_peak_cold_gb']:.2f} / {r['base_peak_warm_gb']:.2f}",
                      f"{r['peak_cold_gb']:.2f} / {r['peak_warm_gb']:.2f}"] for r in rows])
    emit_json("model_memory", rows=rows, threads=args.threads, ctx=args.ctx, load=os.getloadavg())


if __name__ == "__main__":
    main()
