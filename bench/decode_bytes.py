"""Bytes a batch-1 decode token reads, by weight class, in sgrt's int4 mode and in the GGUF file
llama.cpp reads as it is, and each class's time in sgrt's kernel (issue 38).

A batch-1 decode step of a 1B-8B model is bound by memory bandwidth: every weight is read once a
token. So the decode ratio of two engines on the same file is about the ratio of the bytes each
reads a token times the ratio of the read rates each reaches. This bench gives the first factor
and sgrt's side of the second:

- **file**: per class (each layer's ``attn_q/k/v``, ``attn_output``, ``ffn_gate/up``,
  ``ffn_down``; the LM head: ``output``, or ``token_embd`` where the model is tied) the GGML types
  and the bytes a token (what llama.cpp reads: the file's blocks);
- **sgrt**: per fused projection of the loaded int4 model (``qkv_proj``, ``o_proj``,
  ``gate_up_proj``, ``down_proj``; the LM head ``table``/``lm_head``), grouped by how it is held
  (the kernel's stream: ``kq4`` = :func:`sgrt.kernels.woq.fuse_kq4`'s K-quant stream, ``q4`` =
  4-bit codes with a float16 scale and offset per 32, ``q8`` / ``q8c`` = 8-bit codes with both /
  with the scale alone, ``q5`` = the 5-bit part one row reads), its bits a weight, the bytes one
  row reads a token, and the time of one call to every layer of that group in turn on ``--threads``
  threads (calling thread's CPU time with 1 thread, wall time otherwise; the best of
  ``--passes``), with the rate it reads at.

Random activations (the kernels' time does not depend on the values). The sums give the bytes
ratio sgrt / file and sgrt's projections' time a token, to set beside a decode step's time
(``bench/model_memory.py``): what is left is attention, norms and the step's overhead.

Run: ``python bench/decode_bytes.py [--models qwen2-1.5b,llama-1b] [--threads 1] [--passes 5]``
(the files are :mod:`bench.model_memory`'s, built on first use; a path to any GGUF works too).
"""
from __future__ import annotations

import argparse
import re
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import emit_json, print_table  # noqa: E402

# GGUF tensor name (blk.N.<role>.weight) -> the class it is read in
FILE_ROLES = {"attn_q": "qkv", "attn_k": "qkv", "attn_v": "qkv", "attn_output": "o", "ffn_gate": "gate_up",
              "ffn_up": "gate_up", "ffn_down": "down"}


def file_classes(path: Path) -> tuple[dict[str, dict], int]:
    """The GGUF's bytes a decode token by class, ``{class: {"types": {type: bytes}, "bytes": n}}``,
    and the file's size. The LM head is ``output``, else the tied ``token_embd``."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    tensors = {t.name: t for t in reader.tensors}
    out: dict[str, dict] = defaultdict(lambda: {"types": defaultdict(int), "bytes": 0})
    for name, t in tensors.items():
        m = re.match(r"blk\.\d+\.(\w+)\.weight$", name)
        role = FILE_ROLES.get(m.group(1)) if m else None
        if name == "output.weight" or (name == "token_embd.weight" and "output.weight" not in tensors):
            role = "head"
        if role is None:
            continue
        out[role]["types"][t.tensor_type.name] += int(t.n_bytes)
        out[role]["bytes"] += int(t.n_bytes)
    return dict(out), path.stat().st_size


def stream_kind(m) -> tuple[str, int]:
    """How a :class:`~sgrt.models.quant_native.GroupLinear` is held: a short name of its stream
    and the bytes one row of x reads (a 5-bit stream's 5-bit part)."""
    from sgrt.kernels import woq

    sb = m.stream_bits
    if woq.is_kquant(sb):
        return "kq4", m.packed.numel()
    bits, c = woq.stream_format(sb)
    if bits == 5:
        return f"q5{'c' if c else ''}", woq.split5(m.packed, m.out_features, m.in_features, m.group_size, c)[0].numel()
    return f"q{bits}{'c' if c else ''}", m.packed.numel()


def sgrt_classes(path: Path, threads: int, passes: int, cache_dir: Path | None = None) -> list[dict]:
    """Each (projection, stream kind, shape) group of the int4-loaded model: count, bits a weight,
    bytes a token, seconds a token (module docstring). ``cache_dir``: the cache root the load packs
    into (default sgrt's)."""
    import torch

    from sgrt.models import load_model
    from sgrt.models.quant_native import GroupLinear

    torch.set_num_threads(threads)
    model = load_model(str(path), dtype="bfloat16", quantization="int4", cache_dir=cache_dir).model
    groups: dict[tuple, list] = defaultdict(list)
    for name, m in model.named_modules():
        if isinstance(m, GroupLinear):
            kind, read = stream_kind(m)
            groups[(name.split(".")[-1], kind, m.out_features, m.in_features)].append((m, read))
    clock = time.thread_time if threads == 1 else time.perf_counter
    rows = []
    for (proj, kind, n, k), ms in groups.items():
        x = torch.randn(1, k).to(torch.bfloat16)
        for m, _ in ms:
            m(x)
        best = float("inf")
        for _ in range(passes):
            t0 = clock()
            for m, _ in ms:
                m(x)
            best = min(best, clock() - t0)
        read = sum(r for _, r in ms)
        rows.append({"proj": proj, "kind": kind, "n": n, "k": k, "count": len(ms), "bits": 8 * read / (len(ms) * n * k),
                     "bytes": read, "seconds": best})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="qwen2-1.5b,llama-1b", help="bench.model_memory names or GGUF paths")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--passes", type=int, default=5)
    args = ap.parse_args()
    from bench.model_memory import MODELS, ensure_file

    figures = {}
    for name in args.models.split(","):
        path = ensure_file(name) if name in MODELS else Path(name)
        fc, size = file_classes(path)
        rows = sgrt_classes(path, args.threads, args.passes)
        print(f"\n{name}: {path} ({size / 1e9:.3f} GB)")
        print_table(["class", "file types (MB)", "file MB a token"],
                    [[c, ", ".join(f"{t} {b / 1e6:.1f}" for t, b in v["types"].items()), f"{v['bytes'] / 1e6:.1f}"]
                     for c, v in sorted(fc.items())])
        print()
        print_table(["sgrt projection", "stream", "n x k", "layers", "bits a weight", "MB a token", "ms a token",
                     "GB/s"],
                    [[r["proj"], r["kind"], f"{r['n']}x{r['k']}", r["count"], f"{r['bits']:.3f}",
                      f"{r['bytes'] / 1e6:.1f}", f"{r['seconds'] * 1e3:.2f}", f"{r['bytes'] / r['seconds'] / 1e9:.1f}"]
                     for r in sorted(rows, key=lambda r: (r["proj"], r["kind"]))])
        file_total = sum(v["bytes"] for v in fc.values())
        sgrt_total = sum(r["bytes"] for r in rows)
        secs = sum(r["seconds"] for r in rows)
        print(f"bytes a token: file {file_total / 1e6:.1f} MB, sgrt {sgrt_total / 1e6:.1f} MB "
              f"({sgrt_total / file_total:.3f}x); sgrt projections {secs * 1e3:.2f} ms a token on {args.threads} "
              f"thread(s) ({sgrt_total / secs / 1e9:.1f} GB/s)")
        figures[name] = {"file_bytes": file_total, "sgrt_bytes": sgrt_total, "sgrt_seconds": secs,
                         "file_classes": {c: v["bytes"] for c, v in fc.items()}, "sgrt_classes": rows}
    emit_json("decode_bytes", threads=args.threads, passes=args.passes, models=figures)


if __name__ == "__main__":
    main()
