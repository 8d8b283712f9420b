"""Weight-only quantized linear kernels on the CPU: sgrt's native group-wise kernel
(``sgrt/kernels/woq.py``, int4 and int8 codes with float16 scale + offset per group of 32)
against torch's packed kernels, oneDNN bfloat16 and, on AVX2 CPUs, the previous AVX2 kernel.

Per case (one projection shape of the default model, M rows of x): ``--copies`` distinct layers
of that shape (30 = its count in one decode step, so that no method keeps its weights in cache;
fewer from 64 rows on, where the kernels are compute-bound), one pass = every copy once. Times
are the median of ``--passes`` passes (after one warm-up pass), in ms a layer; the passes
alternate between the methods, so that a change in the machine's speed mid-run (a shared
machine: other processes, memory bandwidth) shows in all of them alike, and the script reports
how much CPU time other processes took meanwhile, and the machine's read bandwidth measured in
the same run (``bench/vs_llamacpp.py``'s ``read_bandwidth_gbs``).

- ``ours-int4`` / ``ours-int8``: :func:`sgrt.kernels.woq.linear` (0.625 / 1.125 bytes a weight
  with the float16 scales and offsets); ``GB/s`` = those bytes a layer / its time.
- ``base-int4`` / ``base-int8`` (AVX2 CPUs only): the AVX2 kernel of commit ``--base`` (default:
  the last one with float32 FMAs; ``fc65c15``: the last one with separate scale arrays), its
  source compiled here as library ``sgrt_woq_avx2_base``, given the weight layout it takes.
- ``torch-int4``: ``torch.ops.aten._weight_int4pack_mm_for_cpu`` (codes packed with
  ``_convert_weight_to_int4pack_for_cpu(codes, 2)``, bfloat16 scales_and_zeros [K/32, N, 2])
- ``torch-int8``: ``torch.ops.aten._weight_int8pack_mm`` (per-channel scale)
- ``bf16``: oneDNN prepacked bfloat16 (:class:`sgrt.models.packed.PackedLinear`)

Also the LM head shape (49152, 576) in group-wise int8 (2 copies, 28 M weights each).

Measured (1 thread of the 2-core AMD EPYC with AVX2 only, ``--passes 3 --threads 1``, the
machine loaded ~4x over by other processes, read bandwidth 4.4 GB/s): int4 / base-int4 0.36-0.55
at 16 rows and 0.43-0.58 at 256; int8 / base-int8 0.25-0.36 and 0.21-0.26; LM head int8 0.77 at
1 row, 0.33 at 16; at 1 row (``--rows 1 --passes 7``, 4.5 GB/s read) int4 0.40-0.97 and
int8 0.50-0.89, the new int4 kernel streaming 2.5-3.5 GB/s (56-78% of it). With 2 threads on that
loaded machine every parallel call waited ~16 ms for its second thread: use ``--threads 1`` there.

``--ab REV``: instead, this tree's int4 kernel (``--bits 8``: int8) against commit ``REV``'s (built with the same
flags, as library ``sgrt_woq_avx2_base``; its weights in the layout it takes, so only a base
with the fused stream, ``e0b4e97`` on), on the four projection shapes at ``--rows`` rows
(default 1 and 256), in the calling thread's CPU time (``time.thread_time``: other processes on a
shared machine do not count), ABBA rounds (``--passes``), a sample the best of ``--best-of``
timings (``--base-define NAME=VALUE``: REV's kernel built with that macro, e.g. ``--ab HEAD
--base-define SGRT_WOQ4_STREAMS=4``: a variant of this tree's); prints G weights / s per side,
the median ratio new / base with its range, and whether the outputs are bitwise equal. 1 row:
``--copies`` layers (30: mostly from memory, though 30 of the smaller shapes fit a 32 MB L3:
120 for those; 1: in cache; at most ~400 MB, so one copy of an LM head such as Gemma 3's
262144x640), and ``torch.sum`` over the same weight bytes in the same rounds: the read rate, and
each kernel's share of it; from 64 rows on 2 copies (compute-bound). ``--bits 8``: the int8
kernel instead (e.g. ``--shapes 1536x640,640x2048,262144x640``, Gemma 3's int8 projections and
head).

Run: ``python bench/woq_kernel.py [--rows 1,16,256] [--passes 5] [--threads 2] [--copies 30]
[--base 632e14a] [--methods ...]``; ``python bench/woq_kernel.py --ab 3c0d442 --threads 1
[--rows 1,256] [--copies 30] [--passes 7] [--bits 8] [--shapes ...]``
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.common import emit_json, interleaved_medians, print_table  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
LM_HEAD = (49152, 576)
GROUP = 32
METHODS = ("ours-int4", "base-int4", "ours-int8", "base-int8", "torch-int4", "torch-int8", "bf16")
HEAD_METHODS = ("ours-int8", "base-int8", "torch-int8", "bf16")
# the last commit whose AVX2 kernel widened every code to float32 (fp32 FMAs)
BASE_REV = "632e14a"


# whether the base kernel takes woq.fuse's single stream (codes + scales + offsets) as its weight
_BASE_FUSED = {"fused": False}


def load_base(rev: str, exact: bool = False, defines: tuple[str, ...] = ()) -> bool:
    """Compile commit ``rev``'s ``woq_avx2.cpp`` as library ``sgrt_woq_avx2_base`` and load it
    (``exact``: with the kernel's own flags, ``-ffp-contract=off`` included, so that a kernel with
    the same arithmetic gives bitwise the same outputs; else without it, as the commits before
    that flag were built; ``defines``: ``NAME=VALUE`` macros, e.g. ``SGRT_WOQ4_STREAMS=4``, to
    build a variant). False (with the reason printed) where that fails."""
    from sgrt.kernels import woq
    from sgrt.kernels.build import load_library

    try:
        src = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:sgrt/kernels/woq_avx2.cpp"],
                             check=True, capture_output=True, text=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        print(f"base kernel: cannot read {rev}:sgrt/kernels/woq_avx2.cpp ({e})")
        return False
    _BASE_FUSED["fused"] = "HEADER_BYTES" in src  # (kernels before the fused stream took pack()'s codes)
    src = src.replace("TORCH_LIBRARY(sgrt_woq_avx2,", "TORCH_LIBRARY(sgrt_woq_avx2_base,")
    path = Path(tempfile.gettempdir()) / f"sgrt_woq_avx2_base_{rev}.cpp"
    path.write_text(src)
    flags = list(woq.CFLAGS_AVX2) if exact else [f for f in woq.CFLAGS_AVX2 if f != "-ffp-contract=off"]
    flags += [f"-D{d}" for d in defines]
    reason = load_library("sgrt_woq_avx2_base", path, flags, woq.REQUIRED_CPU_FLAGS_AVX2)
    if reason is not None:
        print(f"base kernel unavailable: {reason}")
    return reason is None


def weight_bytes(method: str, n: int, k: int) -> int:
    """Bytes of one layer's weights as the method stores them."""
    if method.endswith("int4"):
        return n * k // 2 + 4 * n * (k // GROUP)
    if method in ("ours-int8", "base-int8"):
        return n * k + 4 * n * (k // GROUP)
    if method == "torch-int8":
        return n * k + 2 * n
    return 2 * n * k


def make_layers(method: str, n: int, k: int, copies: int, seed: int = 0) -> list:
    """``copies`` distinct layers of shape (n, k): a list of callables ``x -> y``."""
    from sgrt.kernels import woq
    from sgrt.models.packed import PackedLinear

    g = torch.Generator().manual_seed(seed)
    layers = []
    for _ in range(copies):
        bits = 8 if method.endswith("int8") else 4
        codes = torch.randint(0, 2 ** bits, (n, k), dtype=torch.uint8, generator=g)
        scale = torch.rand(n, k // GROUP, generator=g) * 9e-3 + 1e-3
        offset = -(2 ** (bits - 1)) * scale
        if method.startswith(("ours", "base")):
            packed = woq.pack(codes, bits)
            s, o = scale.half(), offset.half()
            kb = bits
            if method.startswith("ours"):
                packed, kb = woq.prepare(packed, s, o, n, k, bits, GROUP)  # (as GroupLinear stores it)
            elif _BASE_FUSED["fused"]:
                packed = woq.fuse(packed, s, o, n, k, bits, GROUP)
            op = woq.kernel() if method.startswith("ours") else torch.ops.sgrt_woq_avx2_base.linear.default
            layers.append(lambda x, op=op, p=packed, s=s, o=o, b=kb: op(x, p, s, o, n, k, b, GROUP))
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
            layers.append(PackedLinear(w.reshape(n, k).bfloat16()))
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


def time_layers(by_method: dict[str, list], x: torch.Tensor, passes: int) -> dict[str, float]:
    """Median ms a layer over ``passes`` passes through each method's layers, alternating
    methods pass by pass."""
    def one(layers: list) -> float:
        t0 = time.perf_counter()
        for layer in layers:
            layer(x)
        return (time.perf_counter() - t0) * 1e3 / len(layers)

    with torch.inference_mode():
        for layers in by_method.values():
            one(layers)  # warm-up (oneDNN primitives, page faults)
        return interleaved_medians(by_method, passes, one)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,16,256")
    ap.add_argument("--head-rows", default="1,16")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--shapes", default=",".join(f"{n}x{k}" for n, k in SHAPES))
    ap.add_argument("--passes", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--copies", type=int, default=30)
    ap.add_argument("--base", default=BASE_REV, help="commit whose AVX2 kernel the base-* methods run")
    ap.add_argument("--bandwidth-mib", type=int, default=512, help="0: skip the read-bandwidth measurement")
    ap.add_argument("--ab", metavar="REV", default="", help="this tree's int4 kernel against commit REV's")
    ap.add_argument("--best-of", type=int, default=3, help="--ab: a sample is the best of this many timings")
    ap.add_argument("--bits", type=int, default=4, choices=(4, 5, 8),
                    help="--ab: the codes' width (5: codes 0..31 as 8-bit codes, offsets -16 scale)")
    ap.add_argument("--base-define", action="append", default=[], metavar="NAME=VALUE",
                    help="--ab: build the base with this macro (repeatable), e.g. SGRT_WOQ4_STREAMS=4 "
                         "with --ab HEAD: a variant of this tree's kernel")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.ab:
        return ab(args)
    rows = [int(r) for r in args.rows.split(",") if r]
    head_rows = [int(r) for r in args.head_rows.split(",") if r]
    methods = [m for m in args.methods.split(",") if m]
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",") if s]

    from sgrt.kernels import woq

    t0 = time.perf_counter()
    if not woq.available():
        sys.exit("the native kernel is unavailable here (see the warning above)")
    print(f"woq.available(): {time.perf_counter() - t0:.2f} s (includes a compile if not cached); isa {woq.isa()}")
    if any(m.startswith("base") for m in methods) and (woq.isa() != "avx2" or not load_base(args.base)):
        methods = [m for m in methods if not m.startswith("base")]
    bandwidth = 0.0
    if args.bandwidth_mib:
        from bench.vs_llamacpp import read_bandwidth_gbs

        bandwidth = read_bandwidth_gbs(args.threads, args.bandwidth_mib)
        print(f"read bandwidth ({args.threads} threads, {args.bandwidth_mib} MiB): {bandwidth:.1f} GB/s")

    results: dict[tuple[str, int], dict[str, float]] = {}
    g = torch.Generator().manual_seed(1)
    busy0, total0 = _cpu_jiffies()
    cpu0 = time.process_time()
    cases = [(s, rows, methods) for s in shapes]
    cases.append((LM_HEAD, head_rows, [m for m in methods if m in HEAD_METHODS]))
    for (n, k), ms, ms_methods in cases:
        for m in ms:
            copies = 2 if (n, k) == LM_HEAD else (args.copies if m <= 16 else max(2, args.copies // 10))
            by_method = {method: make_layers(method, n, k, copies) for method in ms_methods}
            x = torch.randn(m, k, generator=g).bfloat16()
            results[(f"{n}x{k}", m)] = time_layers(by_method, x, args.passes)
            del by_method
    busy1, total1 = _cpu_jiffies()
    # CPU time other processes took meanwhile, as a share of the machine: a benchmark sharing its
    # cores reads slower and noisier.
    hz = os.sysconf("SC_CLK_TCK")
    other = max(0.0, (busy1 - busy0) / hz - (time.process_time() - cpu0))
    other_share = other / max((total1 - total0) / hz, 1e-9)

    pairs = [("ours-int4", "base-int4"), ("ours-int4", "torch-int4"), ("ours-int4", "bf16"),
             ("ours-int8", "base-int8"), ("ours-int8", "torch-int8"), ("ours-int8", "bf16")]
    all_methods = [m for m in METHODS if m in methods]
    pairs = [p for p in pairs if p[0] in all_methods and p[1] in all_methods]
    headers = ["shape", "M", *all_methods, *[f"GB/s {m.split('-')[1]}" for m in all_methods if m.startswith("ours")],
               *[f"{a.split('-')[1]}/{b}" for a, b in pairs]]
    table = []
    figures = {}
    for (shape, m), by in results.items():
        n, k = (int(v) for v in shape.split("x"))
        gbs = {a: weight_bytes(a, n, k) / (by[a] * 1e-3) / 1e9 for a in all_methods if a.startswith("ours") and a in by}
        table.append([shape, m, *(by.get(a, "-") for a in all_methods),
                      *(gbs.get(a, "-") for a in all_methods if a.startswith("ours")),
                      *((by[a] / by[b]) if a in by and b in by else "-" for a, b in pairs)])
        for a, v in by.items():
            figures[f"{shape}_M{m}_{a}_ms"] = round(v, 4)
        for a, v in gbs.items():
            figures[f"{shape}_M{m}_{a}_gbs"] = round(v, 2)
            if m == 1 and bandwidth:
                figures[f"{shape}_M1_{a}_share_of_bandwidth"] = round(v / bandwidth, 3)
        for a, b in pairs:
            if a in by and b in by:
                figures[f"{shape}_M{m}_{a}_over_{b}"] = round(by[a] / by[b], 3)
    print(f"ms a layer ({args.threads} threads, median of {args.passes} passes); GB/s = weight bytes streamed "
          f"(codes + float16 scales and offsets) / time; ratios ours / other (< 1: ours faster)")
    print_table(headers, table)
    if bandwidth:
        print(f"measured read bandwidth: {bandwidth:.1f} GB/s")
    print(f"other processes used {100 * other_share:.0f}% of the machine's CPU time during the run"
          + (" (the figures are unreliable: rerun on a quiet machine)" if other_share > 0.05 else ""))
    emit_json("woq_kernel", threads=args.threads, read_bandwidth_gbs=round(bandwidth, 2),
              other_cpu_share=round(other_share, 3), **figures)


def ab(args) -> None:
    """This tree's int4 (``--bits 8``: int8) kernel against commit ``args.ab``'s, in thread CPU
    time (see the docstring)."""
    import statistics

    from sgrt.kernels import woq

    if not woq.available() or woq.isa() != "avx2" or not load_base(args.ab, exact=True,
                                                                            defines=tuple(args.base_define)):
        sys.exit("--ab needs the AVX2 build and a compilable base kernel")
    if not _BASE_FUSED["fused"]:
        sys.exit(f"--ab: {args.ab}'s kernel predates the fused weight stream")
    sides = {"base": torch.ops.sgrt_woq_avx2_base.linear.default, "new": woq.kernel()}
    rows_list = [int(r) for r in (args.rows if args.rows != "1,16,256" else "1,256").split(",") if r]
    shapes = [tuple(int(v) for v in sh.split("x")) for sh in args.shapes.split(",") if sh]
    gen = torch.Generator().manual_seed(1)
    bits = args.bits
    table, figures = [], {"base": args.ab, "threads": args.threads, "copies": args.copies,
                          "best_of": args.best_of, "bits": bits, "base_defines": args.base_define}
    print(f"load average before: {os.getloadavg()}")
    with torch.inference_mode():
        for n, k in shapes:
            for m in rows_list:
                copies = args.copies if m <= 16 else 2
                copies = max(1, min(copies, int(4e8 // (n * k * bits // 8))))  # (an LM head: one copy)
                # codes (8 + 5 bits: 0..31, --bits 5) with offsets -c * scale (c = 2**(bits - 1)): the
                # new side takes the stream prepare() picks (8-bit codes: the compact one), the base
                # side the full stream of the same codes, scales and offsets
                cbits = 8 if bits == 5 else bits
                layers, base_layers, new_bits = [], [], bits
                for _ in range(copies):
                    codes = torch.randint(0, 2 ** bits, (n, k), dtype=torch.uint8, generator=gen)
                    scale = (torch.rand(n, k // GROUP, generator=gen) * 9e-3 + 1e-3).half()
                    offset = (-(2 ** (bits - 1)) * scale.float()).half()
                    packed = woq.pack(codes, cbits)
                    w, new_bits = woq.prepare(packed, scale, offset, n, k, cbits, GROUP)
                    layers.append(w)
                    base_layers.append(woq.fuse(packed, scale, offset, n, k, cbits, GROUP))
                    del codes, packed
                x = torch.randn(m, k, generator=gen).bfloat16()
                empty = torch.empty(0, dtype=torch.half)
                equal = all(torch.equal(sides["base"](x, wb, empty, empty, n, k, cbits, GROUP).view(torch.int16),
                                        sides["new"](x, w, empty, empty, n, k, new_bits, GROUP).view(torch.int16))
                            for w, wb in zip(layers, base_layers))
                reps = max(1, int(2e7 // (n * k * m * copies)))  # ~20 M weights a timing
                calls = {"base": lambda i, op=sides["base"]: op(x, base_layers[i], empty, empty, n, k, cbits, GROUP),
                         "new": lambda i, op=sides["new"]: op(x, layers[i], empty, empty, n, k, new_bits, GROUP)}
                if m == 1:  # the read rate of the base's bytes (torch.sum, as vs_llamacpp's bandwidth)
                    calls["read"] = lambda i: base_layers[i].view(torch.float32).sum()

                def measure(call) -> float:
                    best = 0.0
                    for _ in range(args.best_of):
                        t0 = time.thread_time()
                        for _ in range(reps):
                            for i in range(len(layers)):
                                call(i)
                        best = max(best, n * k * m * copies * reps / (time.thread_time() - t0) / 1e9)
                    return best

                samples: dict[str, list[float]] = {name: [] for name in calls}
                for r in range(args.passes):
                    for name in (list(calls) if r % 2 == 0 else list(calls)[::-1]):
                        samples[name].append(measure(calls[name]))
                ratios = [b / a for a, b in zip(samples["base"], samples["new"])]  # speed new / base
                base, new = statistics.median(samples["base"]), statistics.median(samples["new"])
                ratio = statistics.median(ratios)
                # the base weight stream's bytes a weight (codes + the 64-byte headers), and the new one's
                stream, new_stream = base_layers[0].numel() / (n * k), layers[0].numel() / (n * k)
                shares = {name: statistics.median(v / r for v, r in zip(samples[name], samples["read"]))
                          for name in ("base", "new")} if "read" in samples else {}
                table.append([f"{n}x{k}", m, copies, round(base, 1), round(new, 1),
                              f"{ratio:.2f} ({min(ratios):.2f}-{max(ratios):.2f})", equal,
                              round(statistics.median(samples["read"]) * stream, 1) if shares else "-",
                              f"{shares['base']:.2f} / {shares['new']:.2f}" if shares else "-",
                              f"{stream:.3f} / {new_stream:.3f}"])
                key = f"{n}x{k}_M{m}"
                figures.update({f"{key}_base_bytes_per_weight": round(stream, 4),
                                f"{key}_new_bytes_per_weight": round(new_stream, 4),
                                f"{key}_base_gws": round(base, 2), f"{key}_new_gws": round(new, 2),
                                f"{key}_speedup": round(ratio, 3), f"{key}_bitwise_equal": equal})
                if shares:
                    figures.update({f"{key}_read_gbs": round(statistics.median(samples["read"]) * stream, 2),
                                    f"{key}_base_share_of_read": round(shares["base"], 3),
                                    f"{key}_new_share_of_read": round(shares["new"], 3)})
    print(f"{args.threads} threads, G int{bits} weights x rows per second of thread CPU time; median of {args.passes} "
          f"ABBA rounds (a sample: the best of {args.best_of}); base = {args.ab}")
    print("read GB/s: torch.sum over the base stream's bytes in the same rounds (1 row); share: the kernel's "
          "weight rate / that, per round, median (a new stream of fewer bytes can pass 1)")
    print_table(["shape", "rows", "copies", "base", "new", "speed new / base (min-max)", "bitwise equal",
                 "read GB/s", "share base / new", "bytes a weight base / new"], table)
    print(f"load average after: {os.getloadavg()}")
    emit_json("woq_kernel_ab", **figures)


if __name__ == "__main__":
    main()
