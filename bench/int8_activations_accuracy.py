"""Accuracy of the int4 kernel's activation precisions against a pure-torch model of llama.cpp's own
Q4_1 x Q8_1 dot product, teacher-forced on the same weights (docs/DESIGN.md, issue 21).

Loads the model once in bfloat16 (the reference: plain layers, as tests/models/test_quantization.py)
and once in int4, then scores the same text with the int4 projections computed five ways:

- ``int16``: sgrt's kernel, default activations (step max|x| / 32258 per block of 32);
- ``int8``: sgrt's kernel, ``int4_activations="int8"`` (``linear_q8``);
- ``sim-int8``: torch model of ``linear_q8``'s formula (checks the simulation against the kernel);
- ``llama.cpp``: torch model of ggml's ``quantize_row_q8_1`` + ``vec_dot_q4_1_q8_1``: per block
  of 32, ``d = max|x| / 127``, ``q = roundf(x / d)`` (half away from zero), ``d`` and
  ``s = d * sum q`` stored as float16, ``y += d_w d_x sum(code q) + m_w s``;
- ``exact-sum``: ``linear_q8``'s q and dx, but the offset term from the block's float sum of x
  (``m_w sum x``): what keeping the min term exact would buy;
- ``float``: no activation quantization (x as given, bfloat16).

The LM head (int8) keeps sgrt's default in every variant. Prints top-1 agreement and mean KL
against bfloat16 per text and ends with one line of JSON.

``--policies int16,int8,int8-prefill``: instead, the ``int4_activations`` policies as served:
the first half of the text prefilled in one chunk, the rest fed one token a step over the KV
pool (decode), every position scored against bfloat16 (so ``int8-prefill`` shows its decode-time
accuracy, prefill's KV included).

    python bench/int8_activations_accuracy.py [--model smollm2-135m-instruct] [--tokens 200]
        [--long-tokens 600] [--modes int16,int8,llama.cpp] [--skip-test-text]
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys
import types

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "models"))


def _codes(mod) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes [N, K/32, 32] float64, d [N, K/32], m [N, K/32] float64) of a 4-bit GroupLinear."""
    from sgrt.kernels import woq

    packed, d, m = mod._unfused()
    n, k = mod.out_features, mod.in_features
    codes = woq.unpack(packed, n, k, 4).to(torch.float64).reshape(n, k // 32, 32)
    return codes, d.double(), m.double()


def _simulate(mode: str, x: torch.Tensor, codes, d, m) -> torch.Tensor:
    xs = x.float().reshape(x.shape[0], -1, 32)
    a = xs.abs().amax(-1)
    if mode == "float":
        xq, dx = xs.double(), torch.ones_like(a, dtype=torch.float64)
        s = xs.double().sum(-1)
    elif mode == "llama.cpp":
        dd = a / 127.0
        inv = torch.where(dd > 0, 1.0 / dd, torch.zeros_like(dd))
        t = xs * inv[..., None]
        q = torch.sign(t) * torch.floor(t.abs() + 0.5)  # roundf: half away from zero
        dx = dd.half().double()
        xq = q.double()
        s = (q.sum(-1) * dd).half().double()  # ggml stores s = d * sum q in float16
    else:  # the kernel's int8: q = rint(x * (127 / a)), dx = a / 127 (float32)
        tiny = a < 2.0 ** -100
        t = xs * (torch.tensor(127.0) / torch.where(tiny, torch.ones_like(a), a))[..., None]
        q = torch.round(t)
        q[tiny] = 0
        dxf = torch.where(tiny, torch.zeros_like(a), a / torch.tensor(127.0))
        dx, xq = dxf.double(), q.double()
        s = q.double().sum(-1) * dx if mode == "sim-int8" else xs.double().sum(-1)
    isum = torch.einsum("mbk,nbk->mnb", xq, codes)
    y = (isum * (d[None] * dx[:, None, :])).sum(-1) + s @ m.T
    return y.to(x.dtype)


def _patch(model, mode: str) -> None:
    from sgrt.models.quant_native import GroupLinear

    for mod in model.modules():
        if isinstance(mod, GroupLinear) and mod.bits == 4 and mod is not model.logits_head:
            if mode in ("int16", "int8"):
                mod.__dict__.pop("forward", None)
                mod._linear = __import__("sgrt.kernels.woq", fromlist=["kernel"]).kernel(mode)
                continue
            if "_sim" not in mod.__dict__:
                mod._sim = _codes(mod)
            mod.forward = types.MethodType(lambda self, x, _m=mode: _simulate(_m, x, *self._sim), mod)


def _served_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """Logits [T, vocab] float32: ids[:T // 2] prefilled in one chunk, then one token a step."""
    from sgrt.engine.attention import PagedAttention, RowSpec
    from sgrt.engine.kv_pool import KVPool

    cfg, t = model.config, len(ids)
    pool = KVPool(t + 8, cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, model.dtype, "cpu")
    half = t // 2
    out = []
    with torch.inference_mode():
        attn = PagedAttention(pool, [RowSpec(list(range(1, half + 1)), half)], native=model.native_ops)
        out.append(model.compute_logits(model(ids[:half], torch.arange(half), attn)))
        for i in range(half, t):
            attn = PagedAttention(pool, [RowSpec(list(range(1, i + 2)), 1)], native=model.native_ops)
            out.append(model.compute_logits(model(ids[i:i + 1], torch.tensor([i]), attn)))
    return torch.cat(out).float()


def served(args, ref, texts) -> dict:
    from sgrt.models import load_model
    from test_quantization import _agreement_and_kl

    result = {}
    for policy in args.policies.split(","):
        lm = load_model(args.model, dtype="bfloat16", quantization="int4", int4_activations=policy)
        lm.model.logits_head_max_rows = 1 << 20
        for name, ids in texts.items():
            with torch.inference_mode():
                want = ref.model.forward_simple(ids).float()
            top1, kl = _agreement_and_kl(want, _served_logits(lm.model, ids))
            result[f"{name}/{policy}"] = {"top1": round(top1, 4), "kl": round(kl, 5)}
            print(f"{args.model} {name} ({len(ids)} tokens, half prefilled, half decoded) {policy:12s} "
                  f"top-1 {top1:6.1%}  KL {kl:.5f}", flush=True)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--long-tokens", type=int, default=600, help="tokens of docs/DESIGN.md as a second text (0: none)")
    ap.add_argument("--modes", default="int16,int8,sim-int8,llama.cpp,exact-sum,float")
    ap.add_argument("--skip-test-text", action="store_true")
    ap.add_argument("--policies", default="", help="score these int4_activations policies as served instead")
    args = ap.parse_args()

    from sgrt.models import load_model
    from test_quantization import TEXT, _agreement_and_kl

    ref = load_model(args.model, dtype="bfloat16", prepack=False)
    texts = {} if args.skip_test_text else {"test text": torch.tensor(ref.tokenizer.encode(TEXT)[:args.tokens])}
    if args.long_tokens:
        design = (ROOT / "docs" / "DESIGN.md").read_text()
        texts["DESIGN.md"] = torch.tensor(ref.tokenizer.encode(design)[:args.long_tokens])
    if args.policies:
        print(json.dumps({"model": args.model, "served": served(args, ref, texts)}))
        return
    lm = load_model(args.model, dtype="bfloat16", quantization="int4")
    lm.model.logits_head_max_rows = 1 << 20
    result = {}
    for name, ids in texts.items():
        with torch.inference_mode():
            want = ref.model.forward_simple(ids).float()
            for mode in args.modes.split(","):
                _patch(lm.model, mode)
                top1, kl = _agreement_and_kl(want, lm.model.forward_simple(ids).float())
                result[f"{name}/{mode}"] = {"top1": round(top1, 4), "kl": round(kl, 5)}
                print(f"{args.model} {name} ({len(ids)} tokens) {mode:10s} top-1 {top1:6.1%}  KL {kl:.5f}", flush=True)
    print(json.dumps({"model": args.model, "accuracy": result}))


if __name__ == "__main__":
    main()
