"""Extend (prefill) attention, the kernel alone: ``torch.ops.sgrt_layer.extend_attention`` against
what :class:`sgrt.engine.attention.PagedAttention` runs without it (SDPA on keys / values gathered
by slot, causal mask with the prefix offset), and SDPA alone on the already gathered tensors.

One row of ``--q-len`` new queries at the end of a ``--kv-len`` context (its slots scattered in a
pool of 4,000), bfloat16, ``--shape`` ``H,HKV,D`` (default SmolLM2's 9, 3, 64). Interleaved rounds
(``--rounds``) of ``--calls`` calls each; a figure is the median over rounds of a round's mean ms
a call, with GFLOP/s (4 * D flops per query head and visible key). Also prints the largest
difference of the kernel's output from a float32 reference and from SDPA in bfloat16.

Run: ``python bench/extend_attention.py [--threads 2] [--q-len 170] [--kv-len 1160] [--shape 9,3,64]``
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from sgrt.kernels import layer_ops  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--q-len", type=int, default=170)
    ap.add_argument("--kv-len", type=int, default=1160)
    ap.add_argument("--shape", default="9,3,64")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=20)
    args = ap.parse_args()
    assert layer_ops.extend_attention_available(), "extend_attention is not available here"
    torch.set_num_threads(args.threads)
    h, hkv, d = (int(x) for x in args.shape.split(","))
    m, n = args.q_len, args.kv_len
    g = torch.Generator().manual_seed(0)
    k_cache = torch.randn(4000, hkv, d, generator=g).to(torch.bfloat16)
    v_cache = torch.randn(4000, hkv, d, generator=g).to(torch.bfloat16)
    slots = torch.randperm(4000, generator=g)[:n].view(1, n)
    q = torch.randn(m, h, d, generator=g).to(torch.bfloat16)
    kv_lens, q_lens = torch.tensor([n]), torch.tensor([m])
    mask = (torch.arange(n).view(1, -1) <= (n - m + torch.arange(m)).view(-1, 1)).view(1, 1, m, n)
    qh = q.transpose(0, 1).unsqueeze(0)  # [1, H, m, D]
    keys_g = k_cache.index_select(0, slots.view(-1)).transpose(0, 1).unsqueeze(0)
    values_g = v_cache.index_select(0, slots.view(-1)).transpose(0, 1).unsqueeze(0)

    def native():
        return torch.ops.sgrt_layer.extend_attention(q, k_cache, v_cache, slots, kv_lens, q_lens)

    def gather_sdpa():
        keys = k_cache.index_select(0, slots.view(-1)).transpose(0, 1).unsqueeze(0)
        values = v_cache.index_select(0, slots.view(-1)).transpose(0, 1).unsqueeze(0)
        return F.scaled_dot_product_attention(qh, keys, values, attn_mask=mask, enable_gqa=True)

    def sdpa():
        return F.scaled_dot_product_attention(qh, keys_g, values_g, attn_mask=mask, enable_gqa=True)

    sides = {"extend_attention": native, "gather+SDPA": gather_sdpa, "SDPA (gathered)": sdpa}
    times: dict[str, list[float]] = {k: [] for k in sides}
    for f in sides.values():
        f()
    for _ in range(args.rounds):
        for name, f in sides.items():
            t = time.perf_counter()
            for _ in range(args.calls):
                f()
            times[name].append((time.perf_counter() - t) / args.calls * 1e3)
    visible = sum(n - m + i + 1 for i in range(m))
    flops = 4 * d * h * visible
    print(f"shape H={h} HKV={hkv} D={d}, q_len {m} over {n} keys, {args.threads} threads, bfloat16")
    for name, ts in times.items():
        ms = statistics.median(ts)
        print(f"  {name:18s} {ms:7.3f} ms  ({min(ts):.3f}-{max(ts):.3f})  {flops / ms / 1e6:6.1f} GFLOP/s")
    got = native().float().view(m, h, d)
    ref32 = F.scaled_dot_product_attention(qh.float(), keys_g.float(), values_g.float(), attn_mask=mask,
                                           enable_gqa=True)[0].transpose(0, 1)
    ref16 = sdpa()[0].transpose(0, 1).float()
    print(f"  max |diff| vs float32 reference {(got - ref32).abs().max().item():.4g}, vs SDPA bfloat16 "
          f"{(got - ref16).abs().max().item():.4g} (SDPA bfloat16 vs float32 {(ref16 - ref32).abs().max().item():.4g})")


if __name__ == "__main__":
    main()
