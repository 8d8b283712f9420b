"""Decode attention over the KV pool, the kernel alone: this tree against a base commit.

Times ``torch.ops.sgrt_layer.decode_attention`` (``sgrt/kernels/layer_ops_cpu/attention.cpp``) at batch 1
on synthetic caches shaped like a model's (``--shape``: ``smollm2`` = 9 query heads, 3 kv heads,
head_dim 64; ``gemma3`` = 4, 1, 256; or ``H,HKV,D``), at each ``--contexts`` length, in
``--dtype`` (bfloat16: the KV pool of a bfloat16 or int4 model; int8: an int8 pool, its codes and
scales from ``kv_pool.quantize_int8``, with bfloat16 queries). One pass calls the kernel on
``--layers`` distinct layers' caches (30, SmolLM2's count: at 8,000 tokens ~190 MB, so the keys
and values come from memory as in a decode step, not from cache); a layer's slots are
contiguous from a random start (``--shuffle``: a random permutation of the pool's slots).

Each side runs in its own process (``--base REV``'s tree exported with ``git archive`` and first
on its ``sys.path``; its library built once into the kernel cache), in ABBA rounds
(``--rounds``), each timing ``--passes`` passes by the calling thread's CPU time
(``time.thread_time``, so that other processes on a shared machine count less; use
``--threads 1`` for that, else wall time); a side's figure is its best pass of a round, and the
ratio base / new (a speedup) is the median over rounds, with its range. Printed per context: ms
a layer, the KV read rate in GB/s (K and V bytes of the context / time) and GFLOP/s (4 * D
flops per query head and key), and whether the two sides' outputs are bitwise equal (a
one-chunk context should be; split contexts sum in another order) with their largest
difference. Ends with one JSON line.

Run: ``python bench/decode_attention.py [--base e1bf453] [--contexts 500,8000] [--shape smollm2]
[--dtype bfloat16] [--threads 1] [--rounds 3] [--passes 5] [--layers 30] [--shuffle]``
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHAPES = {"smollm2": (9, 3, 64), "gemma3": (4, 1, 256)}


def parse_shape(text: str) -> tuple[int, int, int]:
    if text in SHAPES:
        return SHAPES[text]
    h, hkv, d = (int(x) for x in text.split(","))
    return h, hkv, d


def worker(args: argparse.Namespace) -> None:
    """One side: time the kernel, print a JSON line of ms a layer per context and save outputs."""
    sys.path.insert(0, args.sgrt_root)
    import torch

    from sgrt.kernels import layer_ops

    assert layer_ops.available(), "layer_ops library unavailable"
    torch.set_num_threads(args.threads)
    h, hkv, d = parse_shape(args.shape)
    dtype = getattr(torch, args.dtype)
    qdtype = torch.bfloat16 if args.dtype == "int8" else dtype  # (an int8 pool serves bfloat16 models)
    op = torch.ops.sgrt_layer.decode_attention
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    result: dict = {}
    outs = {}
    for ctx in (int(c) for c in args.contexts.split(",")):
        gen = torch.Generator().manual_seed(ctx)
        pool = ctx + 1024
        layers = []
        for _ in range(args.layers):
            k = torch.randn(pool, hkv, d, generator=gen)
            v = torch.randn(pool, hkv, d, generator=gen)
            if args.dtype == "int8":  # an int8 pool: codes and per slot and kv head scales
                from sgrt.engine.kv_pool import quantize_int8

                (k, ks), (v, vs) = quantize_int8(k), quantize_int8(v)
                scales = (ks, vs)
            else:
                k, v, scales = k.to(dtype), v.to(dtype), ()
            if args.shuffle:
                slots = torch.randperm(pool, generator=gen)[:ctx]
            else:
                start = int(torch.randint(0, pool - ctx + 1, (1,), generator=gen))
                slots = torch.arange(start, start + ctx)
            q = torch.randn(1, h, d, generator=gen).to(qdtype)
            layers.append((q, k, v, slots.view(1, ctx).contiguous(), torch.tensor([ctx]), *scales))
        outs[ctx] = torch.stack([op(*a) for a in layers[:2]])
        times = []
        for _ in range(args.passes):
            t0 = clock()
            for a in layers:
                op(*a)
            times.append((clock() - t0) / args.layers * 1e3)
        result[str(ctx)] = min(times)
    torch.save(outs, args.save)
    print(json.dumps(result))


def export_tree(rev: str, into: Path) -> Path:
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev], check=True, capture_output=True).stdout
    into.mkdir(parents=True, exist_ok=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def run_side(root: Path, args: argparse.Namespace, save: Path) -> dict:
    cmd = [sys.executable, __file__, "--worker", "--sgrt-root", str(root), "--save", str(save),
           "--contexts", args.contexts, "--shape", args.shape, "--dtype", args.dtype, "--threads", str(args.threads),
           "--passes", str(args.passes), "--layers", str(args.layers)] + (["--shuffle"] if args.shuffle else [])
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=root).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", default="e1bf453")
    p.add_argument("--contexts", default="500,8000")
    p.add_argument("--shape", default="smollm2")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "int8"])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--passes", type=int, default=5)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--shuffle", action="store_true")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--sgrt-root", default=str(ROOT), help=argparse.SUPPRESS)
    p.add_argument("--save", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    import torch

    h, hkv, d = parse_shape(args.shape)
    contexts = [int(c) for c in args.contexts.split(",")]
    elem = {"bfloat16": 2, "float32": 4, "int8": 1 + 4 / d}[args.dtype]  # (int8: a float32 scale a row of d codes)
    with tempfile.TemporaryDirectory() as tmp:
        base_root = export_tree(args.base, Path(tmp) / "base")
        saves = {"new": Path(tmp) / "new.pt", "base": Path(tmp) / "base.pt"}
        runs: dict[str, list[dict]] = {"new": [], "base": []}
        for r in range(args.rounds):
            order = ["base", "new"] if r % 2 == 0 else ["new", "base"]
            for side in order:
                runs[side].append(run_side(ROOT if side == "new" else base_root, args, saves[side]))
        outs = {side: torch.load(saves[side]) for side in saves}
    rows = []
    for ctx in contexts:
        new_ms = [x[str(ctx)] for x in runs["new"]]
        base_ms = [x[str(ctx)] for x in runs["base"]]
        ratios = [b / n for b, n in zip(base_ms, new_ms)]
        kv_bytes = 2 * ctx * hkv * d * elem
        flops = 4 * d * h * ctx
        nb = min(new_ms)
        a, b = outs["new"][ctx].float(), outs["base"][ctx].float()
        rows.append({
            "context": ctx, "new_ms": round(statistics.median(new_ms), 4), "base_ms": round(statistics.median(base_ms), 4),
            "speedup": round(statistics.median(ratios), 3), "speedup_range": [round(min(ratios), 3), round(max(ratios), 3)],
            "new_gbs": round(kv_bytes / nb / 1e6, 2), "base_gbs": round(kv_bytes / min(base_ms) / 1e6, 2),
            "new_gflops": round(flops / nb / 1e6, 2), "bitwise_equal": bool(torch.equal(a, b)),
            "max_abs_diff": float((a - b).abs().max()),
        })
    print(f"decode attention, shape H={h} HKV={hkv} D={d} {args.dtype}, {args.threads} thread(s), base {args.base}, "
          f"{args.rounds} rounds x {args.passes} passes x {args.layers} layers")
    print(f"{'context':>8} {'new ms':>8} {'base ms':>8} {'speedup':>8} {'range':>14} {'new GB/s':>9} {'base GB/s':>9} "
          f"{'GFLOP/s':>8} {'bitwise':>8} {'max diff':>9}")
    for r in rows:
        print(f"{r['context']:>8} {r['new_ms']:>8.3f} {r['base_ms']:>8.3f} {r['speedup']:>8.2f} "
              f"{str(r['speedup_range']):>14} {r['new_gbs']:>9.2f} {r['base_gbs']:>9.2f} {r['new_gflops']:>8.2f} "
              f"{str(r['bitwise_equal']):>8} {r['max_abs_diff']:>9.2e}")
    print(json.dumps({"bench": "decode_attention", "shape": [h, hkv, d], "dtype": args.dtype, "threads": args.threads,
                      "base": args.base, "rows": rows}))


if __name__ == "__main__":
    main()
