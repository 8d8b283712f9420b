"""Batch-1 decode and prefill: sgrt against llama.cpp on the same GGUF files (issue 21).

For each model (default: the default model's Q4_1 GGUF and Gemma 3 270M's Q4_K_M GGUF), both
engines run the same token ids, alternating pair by pair so that the machine's drift lands on
both sides alike:

- **decode**: a ~60-token prompt, then 128 greedy tokens one at a time (EOS never ends it);
  tok/s counts the tokens after the prompt's forward (sgrt: ``Result.output_tok_per_s``;
  llama.cpp through xllamacpp: the ``predicted_per_second`` of its server's ``timings``, greedy,
  ``ignore_eos``; through llama-cpp-python: 128 single-token ``eval`` calls, the argmax taken in
  between).
- **prefill**: ``--prefill`` prompt tokens (1,024) in one forward; tok/s = tokens / time of that
  forward (sgrt: its TTFT with one chunk; xllamacpp: ``prompt_per_second``, one ubatch).
- **bandwidth limit**: the machine's read bandwidth is measured in the same run (a large tensor
  summed with ``--threads`` threads, median of 5; at the start and after each model, the
  highest reading taken); a decode step reads every weight once (the
  input embedding only one row, unless it is also the output layer) plus the KV of the context,
  so the limit is bandwidth / bytes per token, and sgrt's share is its tok/s over that limit.
  A figure for float32 and bfloat16 (``--dtypes``) comes with its own limit.

llama.cpp comes from ``xllamacpp`` (the ``bench`` extra: a prebuilt CPU wheel of llama.cpp and
its server, driven without HTTP), or else from ``llama-cpp-python`` if that is the one
importable (pip compiles llama.cpp from source, several minutes once); the output says which ran
and its build's CPU features. It runs in a child process of its own
(``bench/llamacpp_process.py``), idle while sgrt runs: in one process the two engines share
torch's libgomp, whose throttled spin-wait then slowed both (sgrt's decode ~67 -> ~40 tok/s,
llama.cpp's 65-81 -> 56-60, on the 2-core development machine), so the figures before that change
understate both. Without either the script prints sgrt's rows and bandwidth shares
alone and says so. Installs nothing itself. Both engines get ``--threads`` threads and the same
token ids (the prompt is given to llama.cpp as ids, not text).

``--torch-kernels-row``: sgrt int4 also on torch's packed kernels (what a CPU without sgrt's
native kernel runs), in the same alternation: a before / after of the native kernel.
``--int4-activations-rows int8,int8-prefill``: sgrt int4 also with those ``int4_activations``
policies (``"int8"``: llama.cpp's activation precision, less accurate; ``"int8-prefill"``: int8 for
calls of >= 32 rows only; docs/DESIGN.md), each an extra labelled row in the same alternation; the
default's figures stay those of the default.

Targets (issue 21): int4 decode >= 2x llama.cpp and >= 60% of its bandwidth limit; bfloat16 and
float32 >= 70% of theirs; prefill >= 3x llama.cpp.

Run: ``python bench/vs_llamacpp.py [--models smollm2-135m-instruct,gemma3-270m-q4-k-m]
[--dtypes float32,bfloat16] [--pairs 4] [--runs 3] [--prefill 1024] [--threads 2] [--torch-kernels-row]
[--int4-activations-rows int8,int8-prefill]``
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.common import emit_json, median_of, print_table, timed  # noqa: E402
from bench.decode import NEW_TOKENS, PROMPT, sgrt_decode_tps, sgrt_prefill_tps  # noqa: E402
from bench.llamacpp_process import LlamaCppProcess, runner_module  # noqa: E402


def read_bandwidth_gbs(threads: int, mib: int = 1024) -> float:
    """Bytes read per second (GB/s) summing a ``mib`` MiB float32 tensor, median of 5."""
    torch.set_num_threads(threads)
    data = torch.ones(mib * 2**20 // 4, dtype=torch.float32)
    data.sum()  # fault the pages in
    return median_of(5, lambda: data.nbytes / timed(lambda: data.sum())[0]) / 1e9


def bytes_per_token(loaded, context: int) -> int:
    """Bytes a batch-1 decode step reads: every weight once (the input embedding one row only,
    unless the output layer is that very tensor; not the prepacked copies that serve larger
    batches beside the dense kernel, nor the 8-bit parts of 5-bit streams), plus K and V of
    ``context`` tokens in every layer."""
    from sgrt.kernels import woq
    from sgrt.models.packed import DenseLinear
    from sgrt.models.quant import weight_bytes
    from sgrt.models.quant_native import GroupEmbedding, GroupLinear

    model = loaded.model
    total = weight_bytes(model)
    for mod in model.modules():  # a prepacked copy beside the dense kernel serves more rows only
        if isinstance(mod, DenseLinear) and mod.above is not None:
            total -= sum(p.numel() * p.element_size() for p in mod.above.parameters())
        if isinstance(mod, GroupLinear) and woq.stream_format(mod.stream_bits)[0] == 5:
            # one row reads a 5-bit stream's 5-bit part; its 8-bit part serves more rows only
            c = woq.stream_format(mod.stream_bits)[1]
            total -= woq.split5(mod.packed, mod.out_features, mod.in_features, mod.group_size, c)[1].numel()
    head = getattr(model, "logits_head", None)
    if isinstance(model.embed_tokens, GroupEmbedding):
        # a quantized table: the tied head's own (counted once, read whole by the head) or the
        # embedding's, of which a step reads one row
        if model.embed_tokens.table is not head:
            total -= sum(b.numel() * b.element_size() for b in model.embed_tokens.table.buffers())
    else:
        embed = model.embed_tokens.weight
        if getattr(model, "lm_head", None) is not None or (
                head is not None and not any(p is embed for p in head.parameters())):
            # the output layer is a separate tensor (a quantized or prepacked copy of a tied one
            # included; a head that computes on the embedding table itself is not one)
            total -= embed.numel() * embed.element_size()
    cfg = loaded.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    kv_elem = 4 if model.dtype == torch.float32 else 2  # the KV pool's dtype follows activations
    return total + 2 * cfg.num_hidden_layers * kv_heads * head_dim * context * kv_elem


def load_torch_kernels(spec: str):
    """``spec`` in int4 on torch's packed kernels (tinygemm int4, per-channel int8 head), as a CPU
    without sgrt's native kernel loads it."""
    from sgrt.models import load_model, quant

    available = quant.native_kernel_available
    quant.native_kernel_available = lambda: False
    try:
        return load_model(spec, dtype="bfloat16", quantization="int4")
    finally:
        quant.native_kernel_available = available


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="smollm2-135m-instruct,gemma3-270m-q4-k-m")
    ap.add_argument("--dtypes", default="float32,bfloat16", help="unquantized sgrt rows (bandwidth share only)")
    ap.add_argument("--pairs", type=int, default=4, help="alternated llama.cpp / sgrt pairs")
    ap.add_argument("--runs", type=int, default=3, help="runs per side in a pair (median)")
    ap.add_argument("--prefill", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--torch-kernels-row", action="store_true",
                    help="also run sgrt int4 on torch's packed kernels (what CPUs without sgrt's native "
                         "kernel run), alternated with the others: a before / after in one invocation")
    ap.add_argument("--int4-activations-rows", default="",
                    help="comma-separated int4_activations policies (int8, int8-prefill) each run as an extra "
                         "row, alternated with the others")
    args = ap.parse_args()
    policies = [p for p in args.int4_activations_rows.split(",") if p]
    torch.set_num_threads(args.threads)
    from sgrt.models import load_model

    runner = runner_module()
    if runner is None:
        print("neither xllamacpp nor llama-cpp-python is installed (pip install -e '.[bench]'): sgrt rows only")
    print(f"load average at start: {os.getloadavg()[0]:.2f} (1 min)")
    # The read bandwidth drifts by up to ~25% over minutes on a shared VM, so it is read at the
    # start and after every model, and the limits use the highest reading (the attainable rate:
    # one low reading would otherwise inflate every share, past 100% in one run).
    readings = [read_bandwidth_gbs(args.threads)]
    figures: dict = {}
    rows = []
    shares: list[tuple[list, str, float, int]] = []  # (table row, figure key, tok/s, bytes a token)
    for spec in [m for m in args.models.split(",") if m]:
        int4 = load_model(spec, dtype="bfloat16", quantization="int4")
        kind, path = int4.source.split(":", 1)
        if kind != "gguf":
            raise SystemExit(f"{spec}: llama.cpp needs a GGUF file, this model loads from {int4.source}")
        tok = int4.tokenizer
        prompt_ids = tok.encode_prompt(PROMPT)
        long_ids = (prompt_ids * (args.prefill // len(prompt_ids) + 1))[: args.prefill]
        context = len(prompt_ids) + NEW_TOKENS // 2  # the mean context of a decode step
        llama = LlamaCppProcess(path, args.threads, args.prefill + 64, args.prefill) if runner is not None else None
        if llama is not None and "llamacpp" not in figures:
            print(f"llama.cpp via {llama.version}")
            figures["llamacpp"] = llama.version
        ours_dec, ours_pre, theirs_dec, theirs_pre = [], [], [], []
        base = load_torch_kernels(spec) if args.torch_kernels_row else None
        base_dec: list[float] = []
        base_pre: list[float] = []
        acts = {p: load_model(spec, dtype="bfloat16", quantization="int4", int4_activations=p) for p in policies}
        acts_dec: dict[str, list[float]] = {p: [] for p in policies}
        acts_pre: dict[str, list[float]] = {p: [] for p in policies}
        for _ in range(args.pairs):
            if base is not None:
                base_dec.append(median_of(args.runs, lambda: sgrt_decode_tps(base, prompt_ids)))
                base_pre.append(median_of(args.runs, lambda: sgrt_prefill_tps(base, long_ids)))
            for p, lm in acts.items():
                acts_dec[p].append(median_of(args.runs, lambda: sgrt_decode_tps(lm, prompt_ids)))
                acts_pre[p].append(median_of(args.runs, lambda: sgrt_prefill_tps(lm, long_ids)))
            if llama is not None:
                theirs_dec.append(median_of(args.runs, lambda: llama.decode_tps(prompt_ids, NEW_TOKENS)))
                theirs_pre.append(median_of(args.runs, lambda: llama.prefill_tps(long_ids)))
            ours_dec.append(median_of(args.runs, lambda: sgrt_decode_tps(int4, prompt_ids)))
            ours_pre.append(median_of(args.runs, lambda: sgrt_prefill_tps(int4, long_ids)))
        dec, pre = statistics.median(ours_dec), statistics.median(ours_pre)
        key = spec.replace("-", "_")
        figures[f"{key}_int4_decode_tok_s"] = round(dec, 1)
        figures[f"{key}_int4_prefill_tok_s"] = round(pre, 1)
        row = [spec, "int4", round(dec, 1), "-", "-", round(pre, 1), "-", "-", "?"]
        shares.append((row, f"{key}_int4_bandwidth_share", dec, bytes_per_token(int4, context)))
        if llama is not None:
            ratios = [a / b for a, b in zip(ours_dec, theirs_dec)]
            pre_ratios = [a / b for a, b in zip(ours_pre, theirs_pre)]
            tdec, tpre = statistics.median(theirs_dec), statistics.median(theirs_pre)
            figures[f"{key}_llamacpp_decode_tok_s"] = round(tdec, 1)
            figures[f"{key}_llamacpp_prefill_tok_s"] = round(tpre, 1)
            figures[f"{key}_decode_ratio"] = round(statistics.median(ratios), 3)
            figures[f"{key}_prefill_ratio"] = round(statistics.median(pre_ratios), 3)
            row[3:5] = [round(tdec, 1), f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})"]
            row[6:8] = [round(tpre, 1), f"{statistics.median(pre_ratios):.2f}"]
        rows.append(row)
        if base is not None:
            bdec, bpre = statistics.median(base_dec), statistics.median(base_pre)
            gain = statistics.median([a / b for a, b in zip(ours_dec, base_dec)])
            figures[f"{key}_int4_torch_kernels_decode_tok_s"] = round(bdec, 1)
            figures[f"{key}_int4_torch_kernels_prefill_tok_s"] = round(bpre, 1)
            figures[f"{key}_int4_native_over_torch_kernels_decode"] = round(gain, 3)
            brow = [spec, "int4 (torch kernels)", round(bdec, 1), "-", "-", round(bpre, 1), "-", "-", "?"]
            shares.append((brow, f"{key}_int4_torch_kernels_bandwidth_share", bdec, bytes_per_token(base, context)))
            if llama is not None:
                bratios = [a / b for a, b in zip(base_dec, theirs_dec)]
                brow[3:5] = [row[3], f"{statistics.median(bratios):.2f} ({min(bratios):.2f}-{max(bratios):.2f})"]
                brow[6:8] = [row[6], f"{statistics.median([a / b for a, b in zip(base_pre, theirs_pre)]):.2f}"]
            rows.append(brow)
            print(f"{spec}: native int4 kernel / torch's kernels, decode: {gain:.2f} (median of pairs)")
            del base
        for p, lm in acts.items():
            tag = "int8_activations" if p == "int8" else p.replace("-", "_") + "_activations"
            adec, apre = statistics.median(acts_dec[p]), statistics.median(acts_pre[p])
            figures[f"{key}_int4_{tag}_decode_tok_s"] = round(adec, 1)
            figures[f"{key}_int4_{tag}_prefill_tok_s"] = round(apre, 1)
            # against the default in the same pairs (the policy's own gain, llama.cpp aside)
            figures[f"{key}_{tag}_over_int16_decode"] = round(
                statistics.median([a / b for a, b in zip(acts_dec[p], ours_dec)]), 3)
            figures[f"{key}_{tag}_over_int16_prefill"] = round(
                statistics.median([a / b for a, b in zip(acts_pre[p], ours_pre)]), 3)
            arow = [spec, f"int4 ({p} activations)", round(adec, 1), "-", "-", round(apre, 1), "-", "-", "?"]
            shares.append((arow, f"{key}_int4_{tag}_bandwidth_share", adec, bytes_per_token(lm, context)))
            if llama is not None:
                aratios = [a / b for a, b in zip(acts_dec[p], theirs_dec)]
                apratios = [a / b for a, b in zip(acts_pre[p], theirs_pre)]
                figures[f"{key}_{tag}_decode_ratio"] = round(statistics.median(aratios), 3)
                figures[f"{key}_{tag}_prefill_ratio"] = round(statistics.median(apratios), 3)
                arow[3:5] = [row[3], f"{statistics.median(aratios):.2f} ({min(aratios):.2f}-{max(aratios):.2f})"]
                arow[6:8] = [row[6], f"{statistics.median(apratios):.2f}"]
            rows.append(arow)
        acts.clear()
        if llama is not None:
            llama.close()
        for dtype in [d for d in args.dtypes.split(",") if d]:
            plain = load_model(spec, dtype=dtype)
            dec = median_of(args.runs, lambda: sgrt_decode_tps(plain, prompt_ids))
            figures[f"{key}_{dtype}_decode_tok_s"] = round(dec, 1)
            rows.append([spec, dtype, round(dec, 1), "-", "-", "-", "-", "-", "?"])
            shares.append((rows[-1], f"{key}_{dtype}_bandwidth_share", dec, bytes_per_token(plain, context)))
            del plain
        readings.append(read_bandwidth_gbs(args.threads))
    bandwidth = max(readings)
    print(f"read bandwidth: {bandwidth:.1f} GB/s, the highest of {len(readings)} readings "
          f"({', '.join(f'{r:.1f}' for r in readings)}; {args.threads} threads)")
    figures["bandwidth_gbs"] = round(bandwidth, 1)
    figures["bandwidth_readings_gbs"] = [round(r, 1) for r in readings]
    for row, name, tok_s, nbytes in shares:
        share = tok_s * nbytes / (bandwidth * 1e9)
        figures[name] = round(share, 3)
        row[-1] = f"{share:.0%}"
    print_table(["model", "sgrt", "decode tok/s", "llama.cpp", "ratio (min-max)", "prefill tok/s",
                 "llama.cpp", "ratio", "bandwidth share"], rows)
    print(f"load average at end: {os.getloadavg()[0]:.2f} (1 min)")
    emit_json("vs_llamacpp", threads=args.threads, new_tokens=NEW_TOKENS, prefill=args.prefill, pairs=args.pairs, **figures)


if __name__ == "__main__":
    main()
