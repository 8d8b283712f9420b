"""Can an exact greedy LM head read less than the int8 head? Candidate counts of "screen, then
rescore" on real hidden states (issue 21).

The idea: keep a cheaper b-bit copy of the int8 LM head (quantized from its dequantized rows,
min/max per group), compute the screen logits ``a = W_b x`` for every row, bound each row's
difference from the int8 head's logit rigorously, ``|f8_j - a_j| <= ||w8_j - w_b_j||_2 ||x||_2``
(Cauchy-Schwarz; any bound that holds for every ``x`` without reading the residual's signs is of
this size), and rescore with the int8 head only the rows that could reach the maximum:
``a_j + E_j >= max_i (a_i - E_i)`` (with both bfloat16 roundings' margins). The greedy token is
then exact; what it saves depends on how few rows are candidates.

This script greedy-decodes ``--tokens`` tokens of each of four prompts with the int4 model
(engine, batch 1), records every input of the LM head, and for each screen prints the candidate
rows (and the 16-row blocks of the int8 kernel's layout they touch) as quantiles over the steps,
and the bytes a step would read: screen + the candidates' blocks (the int8 stream as it is laid
out) or + the candidates' rows alone (a row-major int8 copy), against the full int8 head.

``bits=4`` at the kernel's group sizes runs the real int4 kernel for ``a`` and checks that the
bound holds against the real int8 kernel's outputs on every row (``bound_violations`` must be
0); other bit widths are simulated in float32 (``a = x @ W_b.T``), which is enough to count
candidates.

Run: ``python bench/greedy_head_screen.py [--models smollm2-135m-instruct,gemma3-270m-q4-k-m]
[--tokens 200] [--every 4] [--screens 4:32,4:128,5:32,6:32,7:32]`` (1 thread).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = ("Write a long story about a dragon who learns to cook.",
           "Explain how a transformer language model works, step by step.",
           "def quicksort(arr):\n    \"\"\"Sort a list.\"\"\"\n",
           "The history of the Roman Empire began")


def head_inputs(loaded, tokens: int) -> torch.Tensor:
    """Every LM-head input ``[steps, K]`` bfloat16 of greedy generations of :data:`PROMPTS`."""
    from sgrt.engine import Engine, SamplingParams

    model = loaded.model
    seen: list[torch.Tensor] = []
    compute = model.compute_logits

    def record(hidden: torch.Tensor) -> torch.Tensor:
        seen.append(hidden.detach().clone())
        return compute(hidden)

    model.compute_logits = record
    engine = Engine(model=loaded, max_total_tokens=tokens + 512, enable_radix_cache=False)
    try:
        for p in PROMPTS:
            engine.generate(loaded.tokenizer.encode(p), SamplingParams(max_tokens=tokens, ignore_eos=True))
    finally:
        engine.shutdown()
        model.compute_logits = compute
    return torch.cat(seen).to(torch.bfloat16)


def int8_rows(head) -> torch.Tensor:
    """The int8 head's dequantized weight ``[V, K]`` float64 (exact)."""
    from sgrt.kernels import woq

    n, k, g = head.out_features, head.in_features, head.group_size
    packed, s, o = (woq.unfuse(head.packed, n, k, head.stream_bits, g) if head.fused
                    else (head.packed, head.scales, head.offsets))
    codes = woq.unpack(packed, n, k, 8).double().view(n, k // g, g)
    return (codes * s.double().unsqueeze(-1) + o.double().unsqueeze(-1)).view(n, k)


def screen(w8: torch.Tensor, bits: int, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes, scales, offsets, row residual norms ``||w8_j - w_b_j||_2`` float32, rounded up)."""
    from sgrt.models.quant_native import quantize_groups

    n, k = w8.shape
    codes, s, o = quantize_groups(w8, bits, group)
    wb = (codes.double().view(n, k // group, group) * s.double().unsqueeze(-1) + o.double().unsqueeze(-1)).view(n, k)
    r = (w8 - wb).norm(dim=1) * (1 + 2.0 ** -20)
    return codes, s, o, r.float()


def time_call(layer, x: torch.Tensor, calls: int = 15) -> float:
    """Median thread CPU ms of ``layer(x)`` (after one warm-up call)."""
    layer(x)
    spent = []
    for _ in range(calls):
        t0 = time.thread_time()
        layer(x)
        spent.append((time.thread_time() - t0) * 1e3)
    return round(statistics.median(spent), 3)


def rescore_matches(head, x: torch.Tensor, blocks: torch.Tensor) -> bool:
    """Whether the int8 kernel over only ``blocks`` (16-row blocks gathered out of the fused
    stream) gives bitwise the full head's outputs for those rows."""
    from sgrt.kernels import woq

    n, k = head.out_features, head.in_features
    stream = head.packed.view(n // 16, -1).index_select(0, blocks).reshape(-1)
    none = torch.empty(0, dtype=torch.float16)
    got = woq.kernel()(x, stream, none, none, 16 * blocks.numel(), k, 8, head.group_size)
    rows = (blocks[:, None] * 16 + torch.arange(16)).reshape(-1)
    return bool(torch.equal(got.view(torch.int16), head(x)[:, rows].contiguous().view(torch.int16)))


def quantiles(v: list[int]) -> list[float]:
    t = torch.tensor(v, dtype=torch.float64)
    return [round(float(x), 1) for x in torch.quantile(t, torch.tensor([0.1, 0.5, 0.9, 1.0], dtype=torch.float64))]


def analyse(name: str, args: argparse.Namespace) -> dict[str, object]:
    from sgrt.kernels import woq
    from sgrt.models import load_model
    from sgrt.models.quant_native import GroupLinear

    loaded = load_model(name, dtype="bfloat16", quantization="int4")
    head = loaded.model.logits_head
    if not isinstance(head, GroupLinear) or head.bits != 8:
        raise SystemExit(f"{name}: the LM head is not the native int8 head ({head!r})")
    x = head_inputs(loaded, args.tokens)[:: args.every].contiguous()
    n, k = head.out_features, head.in_features
    exact = head(x).float()  # the int8 kernel: what the full head's argmax reads
    w8 = int8_rows(head)
    head_bytes = n * k + n * k // head.group_size * 4  # (the fused stream: codes, headers)
    nx = x.double().norm(dim=1).float() * (1 + 2.0 ** -12)  # (>= ||x_q||: module docstring of greedy_head)
    top = exact.max(dim=1).values
    out: dict[str, object] = {"model": name, "rows": n, "K": k, "steps": x.shape[0],
                              "head_MB": round(head_bytes / 1e6, 2),
                              "gap_top2_quantiles": None}
    s2 = exact.topk(2, dim=1).values
    out["gap_top2_quantiles"] = quantiles((s2[:, 0] - s2[:, 1]).tolist())
    out["norm_x_median"] = round(float(nx.median()), 2)
    screens = []
    for spec in args.screens.split(","):
        bits, group = (int(v) for v in spec.split(":"))
        if k % group:
            continue
        codes, s, o, r = screen(w8, bits, group)
        real = bits == 4 and woq.isa() == "avx2"
        if real:
            layer = GroupLinear(codes, s, o, 4, group)
            a = layer(x).float()
            timing = {"screen_ms": time_call(layer, x[:1]), "int8_head_ms": time_call(head, x[:1])}
        else:
            timing = {}
            wb = (codes.float().view(n, k // group, group) * s.float().unsqueeze(-1) + o.float().unsqueeze(-1)).view(n, k)
            a = x.float() @ wb.T
            del wb
        # (the int4 kernel rounds a to bfloat16: half a step, 2**-8 |a|; a simulated screen is float32)
        e = nx[:, None] * r[None, :] * (1 + 2.0 ** -10) + a.abs() * ((2.0 ** -8 if real else 0) + 2.0 ** -20) + 1e-30
        violations = int(((exact - a).abs() > e).sum()) if real else None
        cand = (a + e) >= (a - e).max(dim=1, keepdim=True).values - top.abs()[:, None] * 2.0 ** -8
        rows = cand.sum(dim=1).tolist()
        if real:  # rescoring by gathered 16-row blocks gives the full head's bits for those rows
            blk = torch.unique(cand[0].nonzero()[:, 0] // 16)[:64]
            out["rescore_bitwise_equal"] = rescore_matches(head, x[:2].contiguous(), blk)
        blocks = [int(torch.unique(c.nonzero()[:, 0] // 16).numel()) for c in cand]
        screen_bytes = n * k * bits // 8 + n * k // group * 4 + n * 4
        row_bytes = k + k // head.group_size * 4
        per_step_blocks = screen_bytes + sum(blocks) / len(blocks) * 16 * row_bytes
        per_step_rows = screen_bytes + sum(rows) / len(rows) * row_bytes
        screens.append({"bits": bits, "group": group, "kernel": real, "bound_violations": violations,
                        "cand_rows_q10_50_90_max": quantiles(rows), "cand_blocks_q10_50_90_max": quantiles(blocks),
                        "screen_MB": round(screen_bytes / 1e6, 2),
                        "step_MB_blocks": round(per_step_blocks / 1e6, 2),
                        "step_MB_rows": round(per_step_rows / 1e6, 2),
                        "ratio_vs_full_rows": round(per_step_rows / head_bytes, 3), **timing})
        print(f"  {name} screen int{bits} g{group}{' (kernel)' if real else ' (simulated)'}: candidate rows "
              f"q10/50/90/max {screens[-1]['cand_rows_q10_50_90_max']} of {n}, blocks "
              f"{screens[-1]['cand_blocks_q10_50_90_max']} of {n // 16}; MB a step: screen "
              f"{screens[-1]['screen_MB']}, + candidate blocks {screens[-1]['step_MB_blocks']}, + candidate rows "
              f"{screens[-1]['step_MB_rows']} (full int8 head {out['head_MB']})"
              + (f"; bound violations {violations}; 1 row, thread ms: int4 screen {timing['screen_ms']:.2f}, "
                 f"int8 head {timing['int8_head_ms']:.2f}" if real else ""), flush=True)
    out["screens"] = screens
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="smollm2-135m-instruct,gemma3-270m-q4-k-m")
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--every", type=int, default=4, help="analyse every n-th recorded step")
    ap.add_argument("--screens", default="4:32,4:128,4:64,5:32,5:128,5:64,6:128,6:64", help="bits:group,...")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from bench.common import emit_json

    torch.set_num_threads(args.threads)
    results = []
    for name in args.models.split(","):
        res = analyse(name, args)
        print(f"{name}: {res['steps']} steps, ||x|| median {res['norm_x_median']}, top-1 - top-2 gap "
              f"q10/50/90/max {res['gap_top2_quantiles']}")
        results.append(res)
    emit_json("greedy_head_screen", results=results)


if __name__ == "__main__":
    main()
