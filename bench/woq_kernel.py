"""Weight-only quantized linear kernels on the CPU: sgrt's native group-wise kernel
(``sgrt/kernels/woq.py``, int4 and int8 codes with float16 scale + offset per group of 32)
against torch's packed kernels and oneDNN bfloat16.

One pass = every layer of 30 distinct copies of each of the default model's projection shapes
(N, K) = (960, 576) qkv, (576, 576) o, (3072, 576) gate+up, (576, 1536) down: 120 layers, ~106 M
weights, so no method keeps its weights in cache (the same footprint as one decode step).
Times are the median of ``--passes`` passes (after one warm-up pass), in ms, for M rows of x;
the passes alternate between the methods, so that a change in the machine's speed mid-run (a
shared machine: other processes, memory bandwidth) shows in all of them alike, and the script
reports how much CPU time other processes took meanwhile.

- ``ours-int4`` / ``ours-int8``: :func:`sgrt.kernels.woq.linear` (0.625 / 1.125 bytes a weight)
- ``torch-int4``: ``torch.ops.aten._weight_int4pack_mm_for_cpu`` (codes packed with
  ``_convert_weight_to_int4pack_for_cpu(codes, 2)``, bfloat16 scales_and_zeros [K/32, N, 2])
- ``torch-int8``: ``torch.ops.aten._weight_int8pack_mm`` (per-channel scale)
- ``bf16``: oneDNN prepacked bfloat16 (:class:`sgrt.models.packed.PackedLinear`)

Also the LM head shape (49152, 576) (one copy, 28 M weights) at M = 1 and 4.
Targets (issue): int4 at M=1 no slower than torch-int4; int4 at M=16 <= 0.75x bf16;
int8 at M=1 clearly faster than bf16 and at M=16 no slower than bf16. Measured (2 threads, AMD
EPYC with AVX-512 BF16, a shared machine; the table in sgrt/kernels/woq.py is one run): in runs
where bf16 took its usual ~14 ms at M=1, int4 / torch-int4 0.82-0.93 at M=1 (0.73-0.83 at M=2-4),
int4 / bf16 0.49-0.62 at M=16, int8 / bf16 0.40-0.46 at M=1 and 0.61-0.67 at M=16. In one run
where the machine's memory bandwidth had halved (bf16 at M=1: 27.8 ms) int4 / torch-int4 was
0.99 at M=1 and 1.10-1.13 at M=2-4: a memory-bound kernel loses the most there, while torch's
int4 kernel, bound by unpacking from 2 rows on, loses little.

Run: ``python bench/woq_kernel.py [--rows 1,2,4,8,16] [--passes 7] [--threads 2] [--copies 30]``
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.common import emit_json, interleaved_medians, print_table  # noqa: E402

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
LM_HEAD = (49152, 576)
GROUP = 32
METHODS = ("ours-int4", "ours-int8", "torch-int4", "torch-int8", "bf16")


def make_layers(method: str, shapes: list[tuple[int, int]], copies: int, seed: int = 0) -> list:
    """``copies`` distinct layers of each shape: a list of callables ``x -> y``."""
    from sgrt.kernels import woq
    from sgrt.models.packed import PackedLinear

    g = torch.Generator().manual_seed(seed)
    layers = []
    for _ in range(copies):
        for n, k in shapes:
            bits = 8 if method.endswith("int8") else 4
            codes = torch.randint(0, 2 ** bits, (n, k), dtype=torch.uint8, generator=g)
            scale = torch.rand(n, k // GROUP, generator=g) * 9e-3 + 1e-3
            offset = -8 * scale
            if method.startswith("ours"):
                packed = woq.pack(codes, bits)
                s, o = scale.half(), offset.half()
                layers.append(lambda x, p=packed, s=s, o=o, n=n, k=k, b=bits: woq.linear(x, p, s, o, n, k, b, GROUP))
            elif method == "torch-int4":
                packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 2)
                # tinygemm: w = (q - 8) * scale + zero
                sz = torch.stack([scale, offset + 8 * scale], dim=-1).transpose(0, 1).contiguous().bfloat16()
                layers.append(lambda x, p=packed, sz=sz: torch.ops.aten._weight_int4pack_mm_for_cpu(x, p, GROUP, sz))
            elif method == "torch-int8":
                q = (codes.to(torch.int16) - 128).to(torch.int8)
                sc = scale[:, 0].bfloat16().contiguous()
                layers.append(lambda x, q=q, sc=sc: torch.ops.aten._weight_int8pack_mm(x, q, sc))
            elif method == "bf16":
                w = (codes.float().reshape(n, k // GROUP, GROUP) * scale[..., None] + offset[..., None])
                layer = PackedLinear(w.reshape(n, k).bfloat16())
                layers.append(layer)
            else:
                raise ValueError(method)
    return layers


def _cpu_jiffies() -> tuple[int, int]:
    """(busy, total) CPU jiffies of the whole machine, from /proc/stat (0, 0 where unreadable)."""
    try:
        with open("/proc/stat") as f:
            v = [int(t) for t in f.readline().split()[1:]]
    except (OSError, ValueError):
        return 0, 0
    return sum(v[:3]) + sum(v[5:8]), sum(v[:8])


def time_passes(by_method: dict[str, list], xs: dict[int, torch.Tensor], ks: list[int],
                passes: int) -> dict[str, float]:
    """Median ms of one pass over each method's layers (``ks[i]`` = input features of layer i).
    Passes alternate between methods, so that a change in the machine's load or clock mid-run
    affects all of them alike."""
    def one(layers: list) -> float:
        t0 = time.perf_counter()
        for layer, k in zip(layers, ks):
            layer(xs[k])
        return (time.perf_counter() - t0) * 1e3

    with torch.inference_mode():
        for layers in by_method.values():
            one(layers)  # warm-up (oneDNN primitives, page faults)
        return interleaved_medians(by_method, passes, one)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,2,4,8,16")
    ap.add_argument("--head-rows", default="1,4")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--passes", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--copies", type=int, default=30)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = [int(r) for r in args.rows.split(",") if r]
    head_rows = [int(r) for r in args.head_rows.split(",") if r]
    methods = [m for m in args.methods.split(",") if m]

    from sgrt.kernels import woq

    t0 = time.perf_counter()
    if not woq.available():
        sys.exit("the native kernel is unavailable here (see the warning above)")
    print(f"woq.available(): {time.perf_counter() - t0:.2f} s (includes a compile if not cached)")

    results: dict[str, dict[str, float]] = {}
    g = torch.Generator().manual_seed(1)
    busy0, total0 = _cpu_jiffies()
    cpu0 = time.process_time()
    for label, shapes, copies, ms in (("layers", SHAPES, args.copies, rows), ("lm_head", [LM_HEAD], 1, head_rows)):
        if not ms:
            continue
        ks = [k for _ in range(copies) for _, k in shapes]
        by_method = {method: make_layers(method, shapes, copies) for method in methods}
        for m in ms:
            xs = {k: torch.randn(m, k, generator=g).bfloat16() for k in set(ks)}
            results[f"{label} M={m}"] = time_passes(by_method, xs, ks, args.passes)
        del by_method
    busy1, total1 = _cpu_jiffies()
    # CPU time other processes took meanwhile, as a share of the machine: a benchmark sharing its
    # cores reads slower and noisier.
    hz = os.sysconf("SC_CLK_TCK")
    other = max(0.0, (busy1 - busy0) / hz - (time.process_time() - cpu0))
    other_share = other / max((total1 - total0) / hz, 1e-9)

    headers = ["case", *methods]
    ratios = [("ours-int4", "torch-int4"), ("ours-int4", "bf16"), ("ours-int8", "torch-int8"), ("ours-int8", "bf16")]
    ratios = [r for r in ratios if r[0] in methods and r[1] in methods]
    headers += [f"{a.split('-')[1]}/{b}" for a, b in ratios]
    table = []
    figures = {}
    for case, by in results.items():
        table.append([case, *(by[m] for m in methods), *(by[a] / by[b] for a, b in ratios)])
        for m in methods:
            figures[f"{case.replace(' ', '_')}_{m}_ms"] = round(by[m], 3)
    print(f"ms per pass ({args.threads} threads; layers = {len(SHAPES) * args.copies} layers, median of "
          f"{args.passes}); ratios: ours / other (< 1: ours faster)")
    print_table(headers, table)
    print(f"other processes used {100 * other_share:.0f}% of the machine's CPU time during the run"
          + (" (the figures are unreliable: rerun on a quiet machine)" if other_share > 0.05 else ""))
    emit_json("woq_kernel", threads=args.threads, other_cpu_share=round(other_share, 3), **figures)


if __name__ == "__main__":
    main()
