"""The glue of a decode step around the forward, this tree's against a base commit's, in one
process, alternating, with cold caches (issue 21).

The base commit's ``sgrt/models/tokenizer.py``, ``sgrt/models/detokenizer.py`` and
``sgrt/engine/attention.py`` are read with ``git show`` and imported under other names; the
tokenizer files, model config and native operators are this tree's. Items:

- ``detok``: one streamed token through ``IncrementalDetokenizer.add`` (a generated text's tokens
  one by one; us a token);
- ``batch_logits``: the ``[N, V]`` float32 logits the sampler gets from a decode batch of
  ``--batch`` rows: the base side's expression (``torch.cat`` of each row's last logits row,
  sliced per row as the base runner did) against ``ModelRunner``'s ``split`` +
  ``output_processor.last_rows_batch`` (us);
- ``attn_meta``: ``PagedAttention`` for a batch-1 decode step plus the slot tables of every
  window the model's layers use (``native_decode`` of one layer per window: Gemma 3 has a
  512-token window; a 100-token context) (us).

Before each timed call a 64 MB buffer is streamed, as the step's weights are before the Python
that follows the forward. Figures are medians over calls.

Run: ``python bench/step_glue.py --base 3c0d442 [--model gemma3-270m-q4-k-m] [--rounds 200]
[--batch 16]``
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.common import emit_json, print_table  # noqa: E402
from bench.step_overhead import base_module  # noqa: E402

TEXT = ("Once upon a time a dragon named Ember 🐉 learned to cook 人工智能 dishes for the village; "
        "the moral: patience, café au lait and naïve courage win. ") * 8


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="the commit to compare with")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--batch", type=int, default=16)
    args = ap.parse_args()
    torch.set_num_threads(1)
    from sgrt.engine.attention import PagedAttention, RowSpec
    from sgrt.engine.kv_pool import KVPool
    from sgrt.engine.output_processor import last_rows_batch
    from sgrt.kernels import layer_ops
    from sgrt.models import IncrementalDetokenizer, load_model

    with tempfile.TemporaryDirectory() as tmp:
        old_tokenizer = base_module(args.base, "sgrt/models/tokenizer.py", "base_tokenizer", Path(tmp))
        old_detok = base_module(args.base, "sgrt/models/detokenizer.py", "base_detokenizer", Path(tmp))
        old_attention = base_module(args.base, "sgrt/engine/attention.py", "base_attention", Path(tmp))
    loaded = load_model(args.model, dtype="bfloat16", quantization="int4")  # (its config and windows)
    tok = loaded.tokenizer
    tokenizers = {"base": old_tokenizer.Tokenizer(tok.hf), "new": tok}
    detoks = {"base": old_detok.IncrementalDetokenizer, "new": IncrementalDetokenizer}
    ids = tok.encode(TEXT)
    vocab = loaded.config.vocab_size
    windows = sorted(set(loaded.model.layer_windows), key=lambda w: w or 0)
    native = layer_ops.available()
    pool = KVPool(256, 1, 1, 64, torch.bfloat16, torch.device("cpu"))
    slots = list(range(1, 101))
    attentions = {"base": (old_attention.PagedAttention, old_attention.RowSpec), "new": (PagedAttention, RowSpec)}
    head_out = torch.randn(args.batch, vocab)
    flush = torch.zeros(16 << 20)  # 64 MB

    def timed(fn) -> float:
        flush.add_(1.0)
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e6

    def batch_logits(side: str):
        if side == "base":
            rows = [head_out[i: i + 1] for i in range(args.batch)]
            return torch.cat([lg[-1:] for lg in rows], dim=0)
        return last_rows_batch(list(head_out.split([1] * args.batch)))

    def attn_meta(side: str):
        paged, row_spec = attentions[side]
        attn = paged(pool, [row_spec(slots, 1)], cascade=False, native=native)
        if native:
            for w in windows:
                attn.native_decode(0, w)

    assert torch.equal(batch_logits("base"), batch_logits("new"))
    times: dict[tuple[str, str], list[float]] = {}
    streams = {side: (detoks[side](tokenizers[side]), []) for side in ("base", "new")}
    for r in range(args.rounds):
        for side in ("base", "new") if r % 2 == 0 else ("new", "base"):
            detok, chunks = streams[side]
            token = ids[r % len(ids)]
            times.setdefault(("detok", side), []).append(timed(lambda: chunks.append(detok.add(token))))
            times.setdefault(("batch_logits", side), []).append(timed(lambda: batch_logits(side)))
            times.setdefault(("attn_meta", side), []).append(timed(lambda: attn_meta(side)))
    assert streams["base"][1] == streams["new"][1]  # the same chunks, token by token
    figures, rows = {}, []
    for item in ("detok", "batch_logits", "attn_meta"):
        base, new = (statistics.median(times[(item, s)]) for s in ("base", "new"))
        figures[f"{item}_base_us"], figures[f"{item}_new_us"] = round(base, 2), round(new, 2)
        figures[f"{item}_ratio"] = round(new / base, 3)
        rows.append([item, base, new, new / base])
    print(f"decode-step glue (cold caches), {args.model}, batch_logits at batch {args.batch} x {vocab}, "
          f"windows {windows}, median of {args.rounds} alternating calls, us, base {args.base}")
    print_table(["item", "base", "new", "new / base"], rows)
    emit_json("step_glue", base=args.base, model=args.model, rounds=args.rounds, batch=args.batch, **figures)


if __name__ == "__main__":
    main()
