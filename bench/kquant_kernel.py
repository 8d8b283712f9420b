"""Q4_K weights on the AVX2 kernel: the K-quant stream (``woq.fuse_kq4``: the file's super-blocks,
4.625 bits a weight) against the Q4_1-form stream the same blocks had before (``gguf_raw.
unpack_q4_k`` + ``woq.fuse``: a float16 scale and offset per 32 weights, 5 bits), in one run.

Per shape (Llama 3.1 8B's projections by default) ``--copies`` layers of random ``Q4_K`` blocks,
each held in both forms; a pass = every copy once, per form; passes alternate between the forms
(ABBA), and the median over ``--passes`` is reported in ms a layer, with the bytes a layer / that
time (GB/s) and the time ratio K / Q4_1. The machine's load (``os.getloadavg``) is printed beside
the figures: on a shared machine they are not quiet measurements.

Run: ``python bench/kquant_kernel.py [--rows 1,16] [--passes 7] [--copies 3] [--threads 2]
[--shapes 6144x4096,4096x4096,28672x4096,4096x14336]``
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
import torch

from sgrt.kernels import woq
from sgrt.models import gguf_raw

E = torch.empty(0, dtype=torch.float16)


def random_q4_k(rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Raw Q4_K bytes ``[rows, cols / 256 * 144]``: random codes and 6-bit scales, small d / dmin."""
    raw = rng.integers(0, 256, (rows, cols // 256, 144), dtype=np.uint8)
    for at in (0, 2):
        raw[..., at:at + 2] = rng.uniform(1e-4, 1e-3, (rows, cols // 256)).astype(np.float16).view(
            np.uint8).reshape(rows, -1, 2)
    return raw.reshape(rows, -1)


def both_forms(raw: np.ndarray, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the Q4_1-form stream, the K-quant stream) of the same blocks."""
    old = gguf_raw.unpack_q4_k(raw, n, k)
    q41 = woq.fuse(woq.pack(old.codes, 4), old.d, old.m, n, k, 4)
    w = gguf_raw.unpack_q4_k_super(raw, n, k)
    return q41, woq.fuse_kq4(woq.pack(w.codes, 4), w.d, w.dmin, w.sc, w.mn, n, k)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="6144x4096,4096x4096,28672x4096,4096x14336")
    ap.add_argument("--rows", default="1,16")
    ap.add_argument("--passes", type=int, default=7)
    ap.add_argument("--copies", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    if not woq.available() or woq.isa() != "avx2":
        raise SystemExit("needs the AVX2 build of the native kernel")
    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    kern = woq.kernel()
    print(f"threads {args.threads}, load average at start {os.getloadavg()}")
    print("shape        rows  Q4_1-form ms  K-form ms  K/Q4_1  Q4_1 GB/s  K GB/s  max|dy|/max|y|")
    for shape in args.shapes.split(","):
        n, k = (int(v) for v in shape.split("x"))
        layers = [both_forms(random_q4_k(n, k, rng), n, k) for _ in range(args.copies)]
        fmts = (4, woq.KQ4_BITS)
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, k).bfloat16()
            times: list[list[float]] = [[], []]
            for p in range(args.passes + 1):
                order = (0, 1) if p % 2 == 0 else (1, 0)
                for f in order:
                    t0 = time.perf_counter()
                    for layer in layers:
                        kern(x, layer[f], E, E, n, k, fmts[f], 32)
                    if p:  # (pass 0 warms up)
                        times[f].append((time.perf_counter() - t0) / len(layers))
            ms = [statistics.median(t) * 1e3 for t in times]
            nbytes = [layers[0][f].numel() for f in (0, 1)]
            y0, y1 = (kern(x, layers[0][f], E, E, n, k, fmts[f], 32).float() for f in (0, 1))
            diff = ((y0 - y1).abs().max() / y1.abs().max()).item()
            print(f"{shape:12s} {m:4d}  {ms[0]:12.3f}  {ms[1]:9.3f}  {ms[1] / ms[0]:6.3f}  "
                  f"{nbytes[0] / ms[0] / 1e6:9.2f}  {nbytes[1] / ms[1] / 1e6:6.2f}  {diff:.2e}")
    print(f"load average at end {os.getloadavg()}")


if __name__ == "__main__":
    main()
