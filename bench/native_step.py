"""The one-call native decode step against the per-layer native path, in one process (issue 21).

For each model, ``CausalLM.forward`` of one new token on an ``--context``-token context: the
per-layer path (``DecoderLayer.forward`` with the fused operators: ``ops=model.layer_ops``)
and the one-call step (``sgrt.models.native_step``: the whole stack in one C++ call), alternated
``--rounds`` times. Times are the calling thread's CPU time (``time.thread_time``: less moved by
other tenants of a shared machine than wall time; with ``--threads 1`` the whole forward runs on
this thread), or with ``--clock wall`` wall time (``time.perf_counter``: what to use with
``--threads 2``, where the calling thread's CPU time leaves out what it waits for), medians in ms; the ratio is per-layer / one-call (above 1: the step is faster).
Both paths give bit-identical hidden states (checked here once per model too).

``--base REV``: also commit ``REV``'s one-call step, in this process: its ``layer_ops_cpu/`` (or,
before the split, ``layer_ops_cpu.cpp``), ``woq_avx2.cpp`` and ``dense_avx2.cpp`` compiled as
libraries ``sgrt_layer_base`` / ``sgrt_woq_avx2_base`` / ``sgrt_dense_avx2_base`` (with its own
``sgrt/kernels/include``) and its ``sgrt/models/native_step.py`` building
the plan on them (AVX2 builds; the base plan must take this model), alternated with the other
paths; the ratio base / one-call (above 1: this tree's step is faster). Bit-identical to this tree's.
The base plan takes the same weights in the full 8-bit stream where this tree's are compact
(:func:`full_streams`), so it measures the kernels on the same codes, not the load.

``--no-team``: also this tree's one-call step with its thread team off
(``DecodePlan.use_thread_team(False)``: every operator opens its own OpenMP region, as before the
team), alternated with the others; the ratio no-team / one-call (above 1: the team is faster).
Meaningful with ``--threads 2`` (on one thread there is no team). Bit-identical to the others.

``--engine N``: also batch-1 engine decode, output tok/s of one request of ``N`` new tokens
after a 60-token prompt (wall time of the engine's step loop: scheduler, sampler and all), with
the model's one-call step switched off and on, alternated; medians.

Run: ``python bench/native_step.py [--models smollm2:int4,smollm2:bfloat16,smollm2:float32,gemma3:int4]
[--threads 1] [--clock thread|wall] [--rounds 40] [--context 80] [--base 3c0d442] [--no-team]
[--engine 64 --engine-rounds 5]``
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.common import emit_json, print_table  # noqa: E402

MODELS = {"smollm2": "smollm2-135m-instruct", "gemma3": "gemma3-270m-q4-k-m"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="smollm2:int4,smollm2:bfloat16,smollm2:float32,gemma3:int4",
                    help="comma list of model:int4|int8|bfloat16|float32")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--context", type=int, default=80)
    ap.add_argument("--clock", choices=("thread", "wall"), default="thread",
                    help="thread CPU time of the calling thread, or wall time")
    ap.add_argument("--base", default=None, help="also time this commit's one-call step (in this process)")
    ap.add_argument("--no-team", action="store_true", help="also time the one-call step without its thread team")
    ap.add_argument("--engine", type=int, default=0, help="new tokens of the engine decode runs (0: skip)")
    ap.add_argument("--engine-rounds", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from sgrt.engine.attention import PagedAttention, RowSpec
    from sgrt.engine.kv_pool import KVPool
    from sgrt.models import load_model

    base_build = load_base(args.base) if args.base else None
    rows, figures = [], {}
    for item in args.models.split(","):
        name, kind = item.split(":")
        quant = kind if kind in ("int4", "int8") else "none"
        dtype = "bfloat16" if quant != "none" else kind
        loaded = load_model(MODELS[name], dtype=dtype, quantization=quant)
        model = loaded.model
        if model.native_step is None:
            print(f"{item}: no one-call step for this model here (see the log)")
            continue
        cfg = model.config
        pool = KVPool(args.context + 8, cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim,
                      model.dtype, model.device)
        spec = [RowSpec(list(range(1, args.context + 1)), 1)]
        ids, positions = torch.tensor([123]), torch.tensor([args.context - 1])
        paths = {"per_layer": lambda attn: model(ids, positions, attn, ops=model.layer_ops),
                 "one_call": lambda attn: model(ids, positions, attn)}
        if base_build is not None:
            base_step, why = base_build(model)
            if base_step is None:
                sys.exit(f"the base plan does not take {item}: {why}")
            paths["base"] = lambda attn, step=base_step: step.forward(ids, positions, attn)
        if args.no_team:
            paths["no_team"] = lambda attn: no_team(model, ids, positions, attn)
        samples: dict[str, list[float]] = {p: [] for p in paths}
        with torch.inference_mode():
            outs = {p: run(PagedAttention(pool, spec, cascade=False, native=True)) for p, run in paths.items()}
            assert all(torch.equal(outs["per_layer"], o) for o in outs.values()), "the paths disagree"
            for _ in range(3):  # warm-up
                for run in paths.values():
                    run(PagedAttention(pool, spec, cascade=False, native=True))
            clock = time.thread_time if args.clock == "thread" else time.perf_counter
            for _ in range(args.rounds):
                for p, run in paths.items():
                    attn = PagedAttention(pool, spec, cascade=False, native=True)
                    t0 = clock()
                    run(attn)
                    samples[p].append((clock() - t0) * 1e3)
        old, new = statistics.median(samples["per_layer"]), statistics.median(samples["one_call"])
        key = f"{name}_{kind}"
        figures[f"{key}_per_layer_ms"], figures[f"{key}_one_call_ms"] = round(old, 3), round(new, 3)
        figures[f"{key}_ratio"] = round(old / new, 3)
        row = [item, old, new, old / new]
        if base_build is not None:
            base = statistics.median(samples["base"])
            figures[f"{key}_base_one_call_ms"], figures[f"{key}_base_ratio"] = round(base, 3), round(base / new, 3)
            row += [base, base / new]
        if args.no_team:
            plain = statistics.median(samples["no_team"])
            figures[f"{key}_no_team_ms"], figures[f"{key}_no_team_ratio"] = round(plain, 3), round(plain / new, 3)
            row += [plain, plain / new]
        if args.engine:
            tps = engine_tps(loaded, args.engine, args.engine_rounds)
            figures[f"{key}_engine_per_layer_tok_s"] = round(tps["per_layer"], 1)
            figures[f"{key}_engine_one_call_tok_s"] = round(tps["one_call"], 1)
            figures[f"{key}_engine_ratio"] = round(tps["one_call"] / tps["per_layer"], 3)
            row += [tps["per_layer"], tps["one_call"], tps["one_call"] / tps["per_layer"]]
        rows.append(row)
        del model, pool, loaded
    print(f"CausalLM.forward, 1 token at {args.context} tokens of context, {args.threads} thread(s), "
          f"{'thread CPU' if args.clock == 'thread' else 'wall'} time, median of {args.rounds} alternating rounds (ms)")
    headers = ["model", "per-layer ms", "one call ms", "per-layer / one call"]
    if args.base:
        headers += [f"{args.base} one call ms", "base / one call"]
    if args.no_team:
        headers += ["no-team one call ms", "no-team / one call"]
    if args.engine:
        headers += ["engine per-layer tok/s", "engine one call tok/s", "one call / per-layer"]
    print_table(headers, rows)
    emit_json("native_step", threads=args.threads, clock=args.clock, rounds=args.rounds, context=args.context, base=args.base,
              **figures)


BASE_LIBRARIES = {  # base library -> (its sources in sgrt/kernels: the first pattern that matches,
    #                                 the module whose build flags it takes)
    "sgrt_layer": (("layer_ops_cpu/*.cpp", "layer_ops_cpu.cpp"), "layer_ops"),
    "sgrt_woq_avx2": (("woq_avx2.cpp",), "woq"),
    "sgrt_dense_avx2": (("dense_avx2.cpp",), "dense"),
}


def load_base(rev: str):
    """Commit ``rev``'s decode plan in this process: its three libraries compiled under ``_base``
    names, and its ``native_step.build`` with the names changed to them. Returns that build."""
    import io
    import tarfile
    import tempfile

    from sgrt.kernels import dense, layer_ops, woq
    from sgrt.kernels.build import load_library

    def show(path: str) -> str:
        return subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:{path}"], check=True, capture_output=True,
                              text=True).stdout

    if not (layer_ops.available() and dense.available() and woq.isa() == "avx2"):
        sys.exit("--base needs the AVX2 builds of the native kernels")
    flags = {"layer_ops": (layer_ops.CFLAGS, ()), "woq": (woq.CFLAGS_AVX2, woq.REQUIRED_CPU_FLAGS_AVX2),
             "dense": (dense.CFLAGS, dense.REQUIRED_CPU_FLAGS)}
    # the commit's sgrt/kernels (sources, their headers, its include folder) in a folder of its own,
    # needed only while the libraries build (they are cached by content, sgrt/kernels/build.py)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "sgrt/kernels"], check=True,
                             capture_output=True).stdout
    with tempfile.TemporaryDirectory(prefix=f"sgrt_base_{rev}_") as tree:
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            tar.extractall(tree, filter="data")
        kernels = Path(tree) / "sgrt" / "kernels"
        for lib, (patterns, module) in BASE_LIBRARIES.items():
            sources = next((found for p in patterns if (found := sorted(kernels.glob(p)))), [])
            if not sources:
                sys.exit(f"base {lib}: no {' or '.join(patterns)} in {rev}:sgrt/kernels")
            for file in sources:  # (the registration is in one of them)
                src = file.read_text().replace(f"TORCH_LIBRARY({lib},", f"TORCH_LIBRARY({lib}_base,")
                file.write_text(src.replace(f"TORCH_LIBRARY_IMPL({lib},", f"TORCH_LIBRARY_IMPL({lib}_base,"))
            headers = sorted(sources[0].parent.glob("*.h")) if sources[0].parent != kernels else []
            why = load_library(f"{lib}_base", sources, *flags[module], headers=headers,
                               include_dir=kernels / "include")
            if why is not None:
                sys.exit(f"base {lib}: {why}")
    src = show("sgrt/models/native_step.py")
    for lib in BASE_LIBRARIES:
        src = src.replace(f"{lib}::", f"{lib}_base::").replace(f"torch.classes.{lib}.", f"torch.classes.{lib}_base.")
    module = types.ModuleType("native_step_base")
    sys.modules[module.__name__] = module  # (its dataclass looks itself up there)
    exec(compile(src, f"{rev}:sgrt/models/native_step.py", "exec"), module.__dict__)
    if hasattr(module, "_woq_op"):
        # The weight-only operator's name comes from this tree's woq.op_name at run time, not from
        # the text renamed above: without this the base plan called this tree's kernel (through the
        # dispatcher, where its raw-call names differ from the base's).
        this_tree = module._woq_op

        def base_woq_op(*args, **kwargs):
            op = this_tree(*args, **kwargs)
            return op and op.replace("sgrt_woq_avx2::", "sgrt_woq_avx2_base::")

        module._woq_op = base_woq_op
    return lambda model: full_streams(model, module.build)


def full_streams(model, build):
    """``build(model)`` with every GroupLinear whose stream this tree packs otherwise than a base
    may (compact headers: ``woq.stream_bits`` not 4 / 8) given the full 8-bit stream
    of the same codes, scales and offsets for the call (the base plan keeps those tensors)."""
    from sgrt.kernels import woq
    from sgrt.models.quant_native import GroupLinear

    saved = {}
    for mod in model.modules():
        if type(mod) is GroupLinear and mod.fused and mod._args[5] not in (4, 8):
            saved[mod] = mod._args
            packed, scales, offsets = mod._unfused()
            mod._args = (woq.fuse(packed, scales, offsets, mod.out_features, mod.in_features, mod.bits,
                                  mod.group_size),) + mod._args[1:5] + (mod.bits, mod.group_size)
    try:
        return build(model)
    finally:
        for mod, args in saved.items():
            mod._args = args


def no_team(model, ids: torch.Tensor, positions: torch.Tensor, attn) -> torch.Tensor:
    """The model's one-call step with the plan's thread team switched off for this call."""
    plan = model.native_step.plan
    plan.use_thread_team(False)
    try:
        return model.native_step.forward(ids, positions, attn)
    finally:
        plan.use_thread_team(True)


def engine_tps(loaded, new_tokens: int, rounds: int) -> dict[str, float]:
    """Batch-1 decode tok/s of the engine with the one-call step off ("per_layer") and on."""
    from sgrt.engine import Engine, SamplingParams

    model = loaded.model
    step = model.native_step
    prompt = loaded.tokenizer.encode("The harbour was quiet that morning; the fishing boats had left before dawn "
                                     "and only the gulls remained, circling the empty quay. " * 3)[:60]
    engine = Engine(model=loaded, max_total_tokens=1024, enable_radix_cache=False)
    samples: dict[str, list[float]] = {"per_layer": [], "one_call": []}
    try:
        engine.generate(prompt, SamplingParams(max_tokens=8, ignore_eos=True))  # warm-up
        for _ in range(rounds):
            for side in samples:
                model.native_step = step if side == "one_call" else None
                result = engine.generate(prompt, SamplingParams(max_tokens=new_tokens, ignore_eos=True))
                samples[side].append(result.output_tok_per_s)
    finally:
        model.native_step = step
        engine.shutdown()
    return {side: statistics.median(v) for side, v in samples.items()}


if __name__ == "__main__":
    main()
