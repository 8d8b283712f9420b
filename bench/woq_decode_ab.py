"""In-model A/B of the AVX2 group-wise kernel: batch-1 int4 decode tok/s of one loaded model
(the default GGUF's Q4_1 layers and its int8 LM head: 121 ``GroupLinear`` calls a step) with
every ``GroupLinear`` switched between this tree's kernel and the AVX2 kernel of commit
``--base`` (compiled here as ``sgrt_woq_avx2_base`` by ``bench/woq_kernel.py``'s ``load_base``,
given the weight layout it takes), alternating base / new (ABBA) ``--rounds`` times on the same
engine settings as ``bench/decode.py``. Prints tok/s per round, the median ratio new / base,
and one line of JSON. AVX2 CPUs only (the AVX-512 build has no base here).

Measured (``--base fc65c15 --threads 1 --rounds 4``, the 2-core EPYC loaded ~5x over by other
processes): base 24.3-31.3 tok/s, new 31.9-42.5, new / base 1.21-1.52 per round (median 1.44x).
With 2 threads on that loaded machine every parallel call can wait milliseconds for its second
thread (figures 1-15 tok/s): compare on a quiet machine, or with ``--threads 1``.

Run: ``python bench/woq_decode_ab.py [--base fc65c15] [--threads 2] [--rounds 4]``
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.common import emit_json  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", default="fc65c15", help="commit whose AVX2 kernel is the baseline")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from bench import woq_kernel
    from bench.decode import PROMPT, sgrt_decode_tps
    from sgrt.kernels import woq
    from sgrt.models import load_model
    from sgrt.models.quant_native import GroupLinear

    if woq.isa() != "avx2" or not woq_kernel.load_base(args.base):
        sys.exit("needs the AVX2 build and a compilable --base kernel")
    base_op = torch.ops.sgrt_woq_avx2_base.linear.default
    loaded = load_model(args.model, dtype="bfloat16", quantization="int4")
    mods = [m for m in loaded.model.modules() if isinstance(m, GroupLinear)]
    new_state = [(m._linear, m._args) for m in mods]
    base_state = []
    for m in mods:
        n, k, bits, group = m.out_features, m.in_features, m.bits, m.group_size
        packed, scales, offsets = woq.unfuse(m.packed, n, k, m.stream_bits, group)
        if woq_kernel._BASE_FUSED["fused"]:  # (the full stream: compact ones are this tree's)
            packed = woq.fuse(packed, scales, offsets, n, k, bits, group)
        base_state.append((base_op, (packed, scales, offsets, n, k, bits, group)))
    print(f"{len(mods)} GroupLinear layers, {sum(m.packed.numel() for m in mods) / 1e6:.1f} MB a step")

    def use(state: list) -> None:
        for m, (op, a) in zip(mods, state):
            m._linear, m._args = op, a

    prompt_ids = loaded.tokenizer.encode_prompt(PROMPT)
    tps: dict[str, list[float]] = {"base": [], "new": []}
    try:
        for r in range(args.rounds):
            order = [("base", base_state), ("new", new_state)]
            for name, state in (order if r % 2 == 0 else order[::-1]):
                use(state)
                tps[name].append(sgrt_decode_tps(loaded, prompt_ids))
            print(f"round {r}: base {tps['base'][-1]:.1f} tok/s, new {tps['new'][-1]:.1f}", flush=True)
    finally:
        use(new_state)
    ratios = [b / a for a, b in zip(tps["base"], tps["new"])]
    print(f"decode tok/s: base {statistics.median(tps['base']):.1f}, new {statistics.median(tps['new']):.1f}; "
          f"new / base per round {', '.join(f'{x:.2f}' for x in ratios)} (median {statistics.median(ratios):.2f})")
    emit_json("woq_decode_ab", base=args.base, threads=args.threads,
              base_tok_s=round(statistics.median(tps["base"]), 2), new_tok_s=round(statistics.median(tps["new"]), 2),
              new_over_base=round(statistics.median(ratios), 3))


if __name__ == "__main__":
    main()
