"""Dense float32 / bfloat16 matmuls at decode sizes: sgrt's AVX2 kernel (:mod:`sgrt.kernels.dense`)
against torch's paths, in one invocation (issue 21).

For each of the default model's 4 projection shapes (30 copies each, one per layer, ~60-110 MB
in all, so the weights come from memory as in a decode step) and its LM head (49152 x 576, one
copy), and each dtype: read bandwidth (weight bytes / time) of

- ``sgrt``: the kernel, on the plain row-major weight;
- ``torch``: ``F.linear`` on the same weight;
- ``onednn``: torch's oneDNN prepacked layer (:class:`sgrt.models.packed.PackedLinear`), where
  this CPU can prepack the dtype (float32 on AVX2; bfloat16 needs AVX-512 BW).

Rounds alternate the contenders (median of ``--runs``), so a shared machine's drift lands on
all alike; the ratios are the figures to read. Also prints the machine's read bandwidth
(``torch.sum`` over 1 GiB, as ``bench/vs_llamacpp.py`` measures it) and the load average.

``--decode``: instead, batch-1 decode of the default model (``bench/decode.py``'s prompt,
``--tokens`` new tokens) as the loader sets it up (``sgrt``: the kernel where :func:`sgrt.models.packed.dense_kernel_for`
chooses it, forced on for float32 too) against torch's layers (``torch``: bfloat16 plain
``nn.Linear``, float32 oneDNN prepacked: what the loader chose before the kernel), alternated
(median of ``--runs``), with each one's share of its bandwidth limit (``bench/vs_llamacpp.py``'s
bytes per token over the bandwidth measured in the same run).

``--prefill N``: instead, bfloat16 prefill of ``N`` prompt tokens in one chunk (``--models``; TTFT as
``bench/decode.py`` measures it) with the loader's layers, whose prefill-sized calls run
:func:`sgrt.models.packed.linear_bf16_via_f32` (``sgrt``), against the same model with those
calls on torch's bfloat16 ``F.linear`` (``torch``: what ran before), alternated, median of
``--runs``; ``--cpu-time`` reads process CPU seconds instead of wall time (a fairer reading where
other tenants take turns on the cores; use it with ``--threads 1``).

``--ab REV``: instead, the kernel of git revision ``REV`` (``sgrt/kernels/dense_avx2.cpp`` as
committed there, built as a second library, ``sgrt_dense_avx2_base``) against this tree's, in one
process, ABBA-alternated ``--runs`` rounds: per dtype and ``--rows`` value, GB/s of weights read
over the default model's 120 projections in decode order (one copy each, ~210 / 425 MB, so they
stream from DRAM) and over the LM head (49152 x 576), the median of each side and the median
(min-max) of the per-round ratios new / base, and whether both sides' outputs are bitwise equal.
With ``--decode`` too, the model's decode step instead, every :class:`sgrt.models.packed.DenseLinear`
of one loaded model switched between the two kernels. ``--cpu-time`` reads the thread's CPU time
(use it with ``--threads 1``: a fairer reading where other tenants take turns on the cores; with
``--decode``, the process's CPU time over the timed generation); ``--best-of N`` makes each sample
the best of N shorter timings (at 2 threads on a shared machine, the least disturbed one).

``--kernel-share``: instead, per model dtype, one thread, CPU time: a batch-1 decode of the
default model with every :class:`sgrt.models.packed.DenseLinear` call timed (the thread's CPU
time around it), printing the step's CPU ms a token, the kernel's part and the GB/s at which it
reads the weights, beside ``torch.sum``'s read rate over 1 GiB on the same thread: how much of a
step is the weight stream and how much is the rest of the step.

Run: ``python bench/dense_kernel.py [--rows 1] [--threads 2] [--runs 7] [--decode] [--prefill 256]
[--ab HEAD~1]``
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.common import emit_json, interleaved_medians, print_table  # noqa: E402

SHAPES = {"qkv_proj": (960, 576), "o_proj": (576, 576), "gate_up_proj": (3072, 576), "down_proj": (576, 1536),
          "lm_head": (49152, 576)}
LAYERS = 30


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1", help="rows of x (M); --ab: a comma-separated list")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--decode", action="store_true", help="model decode tok/s instead of per-layer GB/s")
    ap.add_argument("--tokens", type=int, default=128, help="--decode: new tokens a run")
    ap.add_argument("--dtypes", default="bfloat16,float32", help="--decode: model dtypes")
    ap.add_argument("--prefill", type=int, default=0, help="bfloat16 prefill tok/s of this many tokens instead")
    ap.add_argument("--models", default="smollm2-135m-instruct,gemma3-270m-q4-k-m", help="--prefill: models")
    ap.add_argument("--cpu-time", action="store_true", help="--prefill / --ab: CPU time instead of wall time")
    ap.add_argument("--ab", metavar="REV", default="", help="this tree's kernel against git revision REV's")
    ap.add_argument("--kernel-share", action="store_true", help="the decode step's CPU time in the kernel (1 thread)")
    ap.add_argument("--best-of", type=int, default=1,
                    help="--ab: a sample is the best of this many timings (the least disturbed one, where other "
                         "tenants take the cores in turns at 2 threads)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.ab:
        return ab(args)
    if args.kernel_share:
        return kernel_share(args)
    if args.decode:
        return decode(args)
    if args.prefill:
        return prefill(args)

    from bench.vs_llamacpp import read_bandwidth_gbs
    from sgrt.kernels import dense
    from sgrt.models.packed import _packed_or_none

    if not dense.available():
        sys.exit("the dense AVX2 kernel is unavailable here (see the log)")
    op = dense.kernel()
    print(f"load average before: {os.getloadavg()}")
    bandwidth = read_bandwidth_gbs(args.threads)
    print(f"read bandwidth: {bandwidth:.1f} GB/s ({args.threads} threads)")
    gen = torch.Generator().manual_seed(0)
    rows, figures = [], {"bandwidth_gbs": round(bandwidth, 1), "rows": args.rows, "threads": args.threads}
    for dtype in (torch.float32, torch.bfloat16):
        dname = str(dtype).removeprefix("torch.")
        for name, (n, k) in SHAPES.items():
            copies = 1 if name == "lm_head" else LAYERS
            weights = [torch.randn(n, k, generator=gen).to(dtype) for _ in range(copies)]
            x = torch.randn(int(args.rows), k, generator=gen).to(dtype)
            nbytes = sum(w.numel() * w.element_size() for w in weights)
            reps = max(1, int(2e8 // nbytes))  # ~200 MB read a sample
            contenders = {"sgrt": lambda: [op(x, w) for w in weights],
                          "torch": lambda: [F.linear(x, w) for w in weights]}
            packed = [_packed_or_none(w, name, check=False) for w in weights]
            if all(p is not None for p in packed):
                contenders["onednn"] = lambda: [p(x) for p in packed]

            def measure(fn) -> float:
                fn()
                t0 = time.perf_counter()
                for _ in range(reps):
                    fn()
                return nbytes * reps / (time.perf_counter() - t0) / 1e9

            gbs = interleaved_medians(contenders, args.runs, measure)
            best_torch = max(v for key, v in gbs.items() if key != "sgrt")
            rows.append([dname, f"{name} {n}x{k}", round(gbs["sgrt"], 2), round(gbs["torch"], 2),
                         round(gbs["onednn"], 2) if "onednn" in gbs else "-", round(gbs["sgrt"] / best_torch, 2),
                         f"{gbs['sgrt'] / bandwidth:.0%}"])
            for key, v in gbs.items():
                figures[f"{dname}_{name}_{key}_gbs"] = round(v, 2)
            figures[f"{dname}_{name}_ratio_vs_best_torch"] = round(gbs["sgrt"] / best_torch, 3)
            del weights, packed
    print(f"M = {args.rows}, {args.threads} threads, GB/s of weights read (median of {args.runs} alternated rounds)")
    print_table(["dtype", "layer", "sgrt", "torch", "onednn", "sgrt / best torch", "sgrt / bandwidth"], rows)
    print(f"load average after: {os.getloadavg()}")
    figures["load_average"] = [round(v, 2) for v in os.getloadavg()]
    emit_json("dense_kernel", **figures)


def decode(args) -> None:
    import bench.decode
    from bench.decode import PROMPT, sgrt_decode_tps
    from bench.vs_llamacpp import bytes_per_token, read_bandwidth_gbs
    from sgrt.models import load_model
    from sgrt.models import packed

    print(f"load average before: {os.getloadavg()}")
    bandwidth = read_bandwidth_gbs(args.threads)
    print(f"read bandwidth: {bandwidth:.1f} GB/s ({args.threads} threads)")
    figures: dict = {"bandwidth_gbs": round(bandwidth, 1), "threads": args.threads}
    rows = []
    bench.decode.NEW_TOKENS = args.tokens
    for dtype in args.dtypes.split(","):
        models = {}
        saved = packed.DENSE_DTYPES_OVER_ONEDNN
        try:
            packed.DENSE_DTYPES_OVER_ONEDNN = packed.DENSE_DTYPES  # the kernel wherever it loads
            models["sgrt"] = load_model("smollm2-135m-instruct", dtype=dtype)
        finally:
            packed.DENSE_DTYPES_OVER_ONEDNN = saved
        # torch's side: float32 oneDNN prepacked (the loader's choice without the kernel),
        # bfloat16 plain layers
        try:
            packed.DENSE_DTYPES_OVER_ONEDNN = ()
            models["torch"] = load_model("smollm2-135m-instruct", dtype=dtype, prepack=dtype == "float32")
        finally:
            packed.DENSE_DTYPES_OVER_ONEDNN = saved
        kinds = {name: type(m.model.layers[0].qkv_proj).__name__ for name, m in models.items()}
        ids = models["sgrt"].tokenizer.encode(PROMPT)
        tps = interleaved_medians(models, args.runs, lambda m: sgrt_decode_tps(m, ids))
        for name, m in models.items():
            share = tps[name] * bytes_per_token(m, len(ids) + args.tokens // 2) / (bandwidth * 1e9)
            rows.append([dtype, f"{name} ({kinds[name]})", round(tps[name], 2), f"{share:.0%}"])
            figures[f"{dtype}_{name}_tok_s"] = round(tps[name], 2)
            figures[f"{dtype}_{name}_bandwidth_share"] = round(share, 3)
        figures[f"{dtype}_sgrt_over_torch"] = round(tps["sgrt"] / tps["torch"], 3)
        del models
    print(f"batch-1 decode, {args.tokens} tokens, {args.threads} threads, median of {args.runs} alternated runs")
    print_table(["dtype", "layers", "tok/s", "bandwidth share"], rows)
    print(f"load average after: {os.getloadavg()}")
    figures["load_average"] = [round(v, 2) for v in os.getloadavg()]
    emit_json("dense_kernel_decode", **figures)


def prefill(args) -> None:
    from bench.decode import PROMPT
    from sgrt.engine import Engine, SamplingParams
    from sgrt.models import load_model
    from sgrt.models import packed

    print(f"load average before: {os.getloadavg()}")
    clock = time.process_time if args.cpu_time else time.perf_counter
    ours = packed.linear_bf16_via_f32
    sides = {"sgrt": ours, "torch": lambda x, w: F.linear(x, w)}
    n = args.prefill
    rows, figures = [], {"threads": args.threads, "prefill_tokens": n, "cpu_time": args.cpu_time}
    for spec in [m for m in args.models.split(",") if m]:
        lm = load_model(spec, dtype="bfloat16")
        kind = type(lm.model.layers[0].qkv_proj).__name__
        ids = lm.tokenizer.encode_prompt(PROMPT)
        ids = (ids * (n // len(ids) + 1))[:n]
        engine = Engine(model=lm, max_total_tokens=n + 64, enable_radix_cache=False,
                        chunked_prefill_size=n, max_prefill_tokens=n)

        def measure(fn) -> float:
            packed.linear_bf16_via_f32 = fn
            try:
                t0 = clock()
                engine.generate(ids, SamplingParams(max_tokens=1))
                return n / (clock() - t0)
            finally:
                packed.linear_bf16_via_f32 = ours

        try:
            engine.generate(ids[:64], SamplingParams(max_tokens=1))  # warm-up
            tps = interleaved_medians(sides, args.runs, measure)
        finally:
            engine.shutdown()
        key = spec.replace("-", "_")
        rows.append([spec, kind, round(tps["sgrt"], 1), round(tps["torch"], 1), round(tps["sgrt"] / tps["torch"], 2)])
        figures[f"{key}_bf16_prefill_sgrt_tok_s"] = round(tps["sgrt"], 1)
        figures[f"{key}_bf16_prefill_torch_tok_s"] = round(tps["torch"], 1)
        figures[f"{key}_bf16_prefill_ratio"] = round(tps["sgrt"] / tps["torch"], 3)
        del engine, lm
    unit = "tok/s of process CPU time" if args.cpu_time else "tok/s"
    print(f"bfloat16 prefill of {n} tokens, {args.threads} threads, {unit}, median of {args.runs} alternated runs")
    print_table(["model", "layers", "sgrt (f32 tiles)", "torch bf16 F.linear", "ratio"], rows)
    print(f"load average after: {os.getloadavg()}")
    figures["load_average"] = [round(v, 2) for v in os.getloadavg()]
    emit_json("dense_kernel_prefill", **figures)


def base_kernel(rev: str):
    """The dense kernel's C++ entry as committed at git revision ``rev``, built and loaded as the
    library ``sgrt_dense_avx2_base`` (cached like the kernel itself, by the source's hash)."""
    import hashlib
    import subprocess
    import tempfile

    from sgrt.kernels import dense
    from sgrt.kernels.build import load_library, operator_entry

    root = Path(__file__).resolve().parent.parent
    source = subprocess.run(["git", "-C", str(root), "show", f"{rev}:sgrt/kernels/dense_avx2.cpp"],
                            check=True, capture_output=True, text=True).stdout
    source = source.replace("TORCH_LIBRARY(sgrt_dense_avx2,", "TORCH_LIBRARY(sgrt_dense_avx2_base,")
    digest = hashlib.sha256(source.encode()).hexdigest()[:16]
    path = Path(tempfile.gettempdir()) / f"sgrt_dense_avx2_base_{digest}.cpp"
    path.write_text(source)
    why = load_library("sgrt_dense_avx2_base", path, dense.CFLAGS, dense.REQUIRED_CPU_FLAGS)
    if why is not None:
        sys.exit(f"building {rev}'s kernel failed: {why}")
    return operator_entry(torch.ops.sgrt_dense_avx2_base.linear.default)


def _abba(sides: dict, runs: int, measure) -> dict[str, list[float]]:
    """``measure(side)`` per side, ``runs`` rounds, the order reversed every other round."""
    names = list(sides)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for r in range(runs):
        for name in (names if r % 2 == 0 else names[::-1]):
            samples[name].append(measure(sides[name]))
    return samples


def _ratio_figures(samples: dict[str, list[float]]) -> tuple[float, float, float, float, float]:
    """Medians of base and new, then the median, min and max of the per-round ratios new / base."""
    import statistics

    ratios = [n / b for b, n in zip(samples["base"], samples["new"])]
    return (statistics.median(samples["base"]), statistics.median(samples["new"]), statistics.median(ratios),
            min(ratios), max(ratios))


def ab(args) -> None:
    from sgrt.kernels import dense

    if not dense.available():
        sys.exit("the dense AVX2 kernel is unavailable here (see the log)")
    sides = {"base": base_kernel(args.ab), "new": dense.kernel()}
    clock = time.thread_time if args.cpu_time else time.perf_counter
    print(f"load average before: {os.getloadavg()}")
    if args.decode:
        return ab_decode(args, sides)
    gen = torch.Generator().manual_seed(0)
    layer_shapes = [SHAPES[name] for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")] * LAYERS
    rows, figures = [], {"base": args.ab, "threads": args.threads, "cpu_time": args.cpu_time,
                         "best_of": args.best_of}
    for dtype in (torch.bfloat16, torch.float32):
        dname = str(dtype).removeprefix("torch.")
        for case, shapes in (("layers", layer_shapes), ("lm_head", [SHAPES["lm_head"]])):
            weights = [torch.randn(n, k, generator=gen).to(dtype) for n, k in shapes]
            nbytes = sum(w.numel() * w.element_size() for w in weights)
            reps = max(1, int(2e8 // nbytes // args.best_of))  # ~200 MB read a sample
            for m in [int(v) for v in args.rows.split(",")]:
                xs = {k: torch.randn(m, k, generator=gen).to(dtype) for k in {k for _, k in shapes}}
                calls = [(xs[w.shape[1]], w) for w in weights]
                equal = all(torch.equal(sides["base"](x, w).view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                                        sides["new"](x, w).view(torch.int16 if dtype == torch.bfloat16 else torch.int32))
                            for x, w in calls)

                def measure(op) -> float:
                    for x, w in calls[:4]:
                        op(x, w)
                    best = 0.0
                    for _ in range(args.best_of):
                        t0 = clock()
                        for _ in range(reps):
                            for x, w in calls:
                                op(x, w)
                        best = max(best, nbytes * reps / (clock() - t0) / 1e9)
                    return best

                base, new, ratio, lo, hi = _ratio_figures(_abba(sides, args.runs, measure))
                rows.append([dname, case, m, round(base, 2), round(new, 2), f"{ratio:.2f} ({lo:.2f}-{hi:.2f})", equal])
                key = f"{dname}_{case}_m{m}"
                figures.update({f"{key}_base_gbs": round(base, 2), f"{key}_new_gbs": round(new, 2),
                                f"{key}_ratio": round(ratio, 3), f"{key}_bitwise_equal": equal})
            del weights
    unit = "GB/s of weights read per second of thread CPU time" if args.cpu_time else "GB/s of weights read"
    print(f"{args.threads} threads, {unit}; median of {args.runs} ABBA rounds (a sample: the best of "
          f"{args.best_of}); base = {args.ab}")
    print_table(["dtype", "weights", "rows", "base", "new", "new / base (min-max)", "bitwise equal"], rows)
    print(f"load average after: {os.getloadavg()}")
    figures["load_average"] = [round(v, 2) for v in os.getloadavg()]
    emit_json("dense_kernel_ab", **figures)


def _load_on_dense_kernel(dtype: str):
    """The default model in ``dtype`` with every float projection on the dense kernel (wherever it
    loads, oneDNN's prepacking not preferred), and its ``DenseLinear`` layers."""
    from sgrt.models import load_model
    from sgrt.models import packed

    saved = packed.DENSE_DTYPES_OVER_ONEDNN
    try:
        packed.DENSE_DTYPES_OVER_ONEDNN = packed.DENSE_DTYPES  # the kernel wherever it loads
        lm = load_model("smollm2-135m-instruct", dtype=dtype)
    finally:
        packed.DENSE_DTYPES_OVER_ONEDNN = saved
    return lm, [mod for mod in lm.model.modules() if isinstance(mod, packed.DenseLinear)]


def ab_decode(args, sides: dict) -> None:
    import bench.decode
    from bench.decode import PROMPT, sgrt_decode_tps
    from sgrt.engine import Engine, SamplingParams

    bench.decode.NEW_TOKENS = args.tokens
    rows, figures = [], {"base": args.ab, "cpu_time": args.cpu_time, "threads": args.threads, "tokens": args.tokens}
    for dtype in args.dtypes.split(","):
        lm, layers = _load_on_dense_kernel(dtype)
        ids = lm.tokenizer.encode(PROMPT)

        def measure(op) -> float:
            for mod in layers:
                mod._linear = op
            if not args.cpu_time:
                return sgrt_decode_tps(lm, ids)
            engine = Engine(model=lm, max_total_tokens=1024, enable_radix_cache=False)
            try:  # as sgrt_decode_tps, over the process's CPU seconds (the engine's loop thread)
                engine.generate(ids, SamplingParams(max_tokens=8, ignore_eos=True))
                t0 = time.process_time()
                out = engine.generate(ids, SamplingParams(max_tokens=args.tokens, ignore_eos=True))
                return out.completion_tokens / (time.process_time() - t0)
            finally:
                engine.shutdown()

        base, new, ratio, lo, hi = _ratio_figures(_abba(sides, args.runs, measure))
        rows.append([dtype, len(layers), round(base, 2), round(new, 2), f"{ratio:.2f} ({lo:.2f}-{hi:.2f})"])
        figures.update({f"{dtype}_base_tok_s": round(base, 2), f"{dtype}_new_tok_s": round(new, 2),
                        f"{dtype}_ratio": round(ratio, 3)})
        del lm, layers
    unit = "tok/s of process CPU time" if args.cpu_time else "tok/s"
    print(f"batch-1 decode, {args.tokens} tokens, {args.threads} threads, {unit}, median of {args.runs} ABBA "
          f"rounds; base = {args.ab}")
    print_table(["dtype", "DenseLinear layers", "base tok/s", "new tok/s", "new / base (min-max)"], rows)
    print(f"load average after: {os.getloadavg()}")
    figures["load_average"] = [round(v, 2) for v in os.getloadavg()]
    emit_json("dense_kernel_ab_decode", **figures)


def kernel_share(args) -> None:
    from bench.decode import PROMPT
    from sgrt.engine import Engine, SamplingParams

    torch.set_num_threads(1)
    print(f"load average before: {os.getloadavg()}")
    data = torch.ones(2**28, dtype=torch.float32)
    data.sum()  # fault the pages in
    rows, figures = [], {"tokens": args.tokens}
    for dtype in args.dtypes.split(","):
        lm, layers = _load_on_dense_kernel(dtype)
        weight_bytes = sum(mod.weight.numel() * mod.weight.element_size() for mod in layers)
        spent = {"s": 0.0, "calls": 0}

        def timed(x, w, op=layers[0]._linear):
            t0 = time.thread_time()
            y = op(x, w)
            spent["s"] += time.thread_time() - t0
            spent["calls"] += 1
            return y

        for mod in layers:
            mod._linear = timed
        ids = lm.tokenizer.encode(PROMPT)
        engine = Engine(model=lm, max_total_tokens=1024, enable_radix_cache=False)
        try:
            engine.generate(ids, SamplingParams(max_tokens=8, ignore_eos=True))
            spent.update(s=0.0, calls=0)
            t0 = time.process_time()
            out = engine.generate(ids, SamplingParams(max_tokens=args.tokens, ignore_eos=True))
            step_s = (time.process_time() - t0) / out.completion_tokens
        finally:
            engine.shutdown()
        steps = spent["calls"] / len(layers)  # decode steps that ran the layers (not the prefill)
        kernel_s = spent["s"] / steps
        sums = []
        for _ in range(5):
            t0 = time.thread_time()
            data.sum()
            sums.append(data.nbytes / (time.thread_time() - t0) / 1e9)
        sum_gbs = sorted(sums)[2]
        kernel_gbs = weight_bytes / kernel_s / 1e9
        rows.append([dtype, round(weight_bytes / 1e6), round(step_s * 1e3, 1), round(kernel_s * 1e3, 1),
                     round(kernel_gbs, 1), round(sum_gbs, 1), f"{kernel_gbs / sum_gbs:.0%}",
                     round((step_s - kernel_s) * 1e3, 1)])
        figures.update({f"{dtype}_step_cpu_ms": round(step_s * 1e3, 2), f"{dtype}_kernel_cpu_ms": round(kernel_s * 1e3, 2),
                        f"{dtype}_kernel_gbs": round(kernel_gbs, 2), f"{dtype}_torch_sum_gbs": round(sum_gbs, 2)})
        del lm, layers, engine
    print(f"batch-1 decode, {args.tokens} tokens, 1 thread, CPU time a token")
    print_table(["dtype", "weights MB", "step ms", "kernel ms", "kernel GB/s", "torch.sum GB/s", "kernel / sum",
                 "rest ms"], rows)
    print(f"load average after: {os.getloadavg()}")
    figures["load_average"] = [round(v, 2) for v in os.getloadavg()]
    emit_json("dense_kernel_share", **figures)


if __name__ == "__main__":
    main()
