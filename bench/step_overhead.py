"""Decode-step overhead: this tree's decoder-layer code and greedy sampler against a base
commit's, in one process, alternating (issue 21).

The base commit's ``sgrt/models/layers.py`` and ``sgrt/engine/sampler.py`` are read with
``git show`` and imported under other names; the model, its weights and the native operators are
this tree's, so the A/B isolates the Python / dispatch path of a batch-1 decode step:

- ``forward``: ``CausalLM.forward`` for one token on an 80-token context (the layers' loop, with
  the base commit's ``DecoderLayer.forward`` swapped in for the base side);
- ``sample``: the greedy ``sample`` of one float32 logits row (the vocabulary's size);
- ``attn_meta``: ``PagedAttention`` for that step (its slot tables), base commit's
  ``sgrt/engine/attention.py`` against this tree's.

With ``--cold`` a 64 MB buffer is streamed before each timed ``sample`` / ``attn_meta`` call, as
the step's weights are before the Python that follows the forward (whose code and data are then
out of cache: each op costs several times its warm time).

Each round times every item once per side, alternating; the figures are medians over rounds, in
ms (forward) and us (sample). Native operators shared by both sides (e.g. a faster
``silu_mul`` build) speed up both, so they do not show here: ``bench/decode.py`` measures them.

Run: ``python bench/step_overhead.py --base 632e14a [--quantization int4] [--threads 1] [--rounds 60] [--cold]``
"""
from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.common import emit_json, print_table  # noqa: E402


def base_module(rev: str, path: str, name: str, into: Path):
    """Import ``path`` as it is at commit ``rev``, as module ``name``."""
    src = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:{path}"], check=True, capture_output=True).stdout
    file = into / f"{name}.py"
    file.write_bytes(src)
    spec = importlib.util.spec_from_file_location(name, file)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # (dataclasses look their module up)
    spec.loader.exec_module(mod)
    return mod


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="the commit to compare with")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--quantization", default="int4")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--cold", action="store_true", help="evict the caches before each sample / attn_meta call")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from sgrt.engine import sampler
    from sgrt.engine.attention import PagedAttention, RowSpec
    from sgrt.engine.kv_pool import KVPool
    from sgrt.engine.request import Req
    from sgrt.engine.sampling_params import SamplingParams
    from sgrt.models import layers, load_model

    with tempfile.TemporaryDirectory() as tmp:
        old_layers = base_module(args.base, "sgrt/models/layers.py", "base_layers", Path(tmp))
        old_sampler = base_module(args.base, "sgrt/engine/sampler.py", "base_sampler", Path(tmp))
        old_attention = base_module(args.base, "sgrt/engine/attention.py", "base_attention", Path(tmp))
    lm = load_model(args.model, dtype=args.dtype, quantization=args.quantization)
    model, cfg = lm.model, lm.config
    pool = KVPool(256, cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, model.dtype, model.device)
    slots = list(range(1, 81))
    ids, positions = torch.tensor([123]), torch.tensor([79])
    forwards = {"base": old_layers.DecoderLayer.forward, "new": layers.DecoderLayer.forward}
    logits = torch.randn(1, cfg.vocab_size, generator=torch.Generator().manual_seed(0))
    greedy = Req("r", [1, 2, 3], SamplingParams(temperature=0.0))
    samplers = {"base": old_sampler.sample, "new": sampler.sample}
    attentions = {"base": (old_attention.PagedAttention, old_attention.RowSpec), "new": (PagedAttention, RowSpec)}
    flush = torch.zeros(16 << 20) if args.cold else None  # 64 MB

    def evict() -> None:
        if flush is not None:
            flush.add_(1.0)

    def run_forward(side: str) -> float:
        layers.DecoderLayer.forward = forwards[side]
        attn = PagedAttention(pool, [RowSpec(slots, 1)], cascade=False, native=model.native_ops)
        t0 = time.perf_counter()
        model(ids, positions, attn)
        return (time.perf_counter() - t0) * 1e3

    def run_sample(side: str) -> float:
        evict()
        t0 = time.perf_counter()
        samplers[side](logits, [greedy], None, set())
        return (time.perf_counter() - t0) * 1e6

    def run_attn_meta(side: str) -> float:
        paged, row_spec = attentions[side]
        evict()
        t0 = time.perf_counter()
        paged(pool, [row_spec(slots, 1)], cascade=False, native=model.native_ops)
        return (time.perf_counter() - t0) * 1e6

    times: dict[tuple[str, str], list[float]] = {}
    try:
        with torch.inference_mode():
            for side in ("base", "new") * 3:  # warm-up
                run_forward(side)
                run_sample(side)
            assert samplers["base"](logits, [greedy], None, set()).token_ids == \
                samplers["new"](logits, [greedy], None, set()).token_ids
            for _ in range(args.rounds):
                for side in ("base", "new"):
                    times.setdefault(("forward", side), []).append(run_forward(side))
                    times.setdefault(("sample", side), []).append(run_sample(side))
                    times.setdefault(("attn_meta", side), []).append(run_attn_meta(side))
    finally:
        layers.DecoderLayer.forward = forwards["new"]
    figures = {}
    rows = []
    for item, unit in (("forward", "ms"), ("sample", "us"), ("attn_meta", "us")):
        base, new = (statistics.median(times[(item, s)]) for s in ("base", "new"))
        figures[f"{item}_base_{unit}"], figures[f"{item}_new_{unit}"] = round(base, 3), round(new, 3)
        figures[f"{item}_ratio"] = round(new / base, 3)
        rows.append([item, unit, base, new, new / base])
    print(f"batch-1 decode step pieces{' (cold caches)' if args.cold else ''}, {args.quantization} / {args.dtype}, {args.threads} threads, "
          f"median of {args.rounds} alternating rounds, base {args.base}")
    print_table(["item", "unit", "base", "new", "new / base"], rows)
    emit_json("step_overhead", base=args.base, model=args.model, quantization=args.quantization,
              threads=args.threads, rounds=args.rounds, cold=args.cold, **figures)


if __name__ == "__main__":
    main()
