"""The int8 KV cache (``kv_cache_dtype="int8"``, sgrt/engine/kv_pool.py) end to end on the default
model in bfloat16: logits of a decode against the bfloat16 pool's (native path and torch path),
greedy output through the engine, radix-cache reuse and shared-prefix forks, the option's checks."""
from __future__ import annotations

import threading

import pytest
import torch

from sgrt.engine import Engine, EngineConfig, SamplingParams
from sgrt.engine.attention import PagedAttention, RowSpec
from sgrt.engine.kv_pool import KVPool
from sgrt.errors import InvalidRequest

from .conftest import assert_same_greedy

PROMPT = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
          "movable metal type, oil-based ink and a wooden press. Within fifty years printers in more than two "
          "hundred cities had produced millions of books, and the price of a book fell so far that")
STEPS = 24
# Per-step bound on max |logit difference| between int8 and bfloat16 K/V (SmolLM2-135M, logits of
# magnitude ~10-30). Measured 0.25-0.75 (2026-12-06, both paths); wrong scales (e.g. K scales
# doubled) move logits by several units.
MAX_LOGIT_DIFF = 1.5
# A top-two gap (logits) within which int8 K/V may pick the other token: two bfloat16 steps at
# logits of 16-32 (measured flips: gaps 0.000 and 0.125).
NEAR_TIE = 0.25


@pytest.fixture(scope="module")
def bf16_model():
    from sgrt.models import load_model

    return load_model("smollm2-135m-instruct", dtype="bfloat16", device="cpu")


def _decode_logits(model, kv_cache_dtype: str, ids: list[int], feed: list[int] | None, steps: int = STEPS,
                   corrupt=None) -> tuple[list[torch.Tensor], list[int]]:
    """Prefill ``ids`` into a fresh pool, then ``steps`` decode steps (feeding ``feed``'s tokens, else
    the greedy ones); returns each step's next-token logits (float32 ``[V]``) and the tokens fed."""
    cfg = model.config
    pool = KVPool(len(ids) + steps + 1, cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, model.dtype,
                  "cpu", kv_cache_dtype=kv_cache_dtype)
    slots = list(range(1, len(ids) + 1))
    native = model.native_ops
    logits, fed = [], []
    with torch.inference_mode():
        attn = PagedAttention(pool, [RowSpec(list(slots), len(ids))], native=native)
        hidden = model(torch.tensor(ids), torch.arange(len(ids)), attn)
        logits.append(model.compute_logits(hidden[-1:])[0].float())
        if corrupt is not None:
            corrupt(pool)
        for i in range(steps):
            tok = feed[i] if feed is not None else int(logits[-1].argmax())
            fed.append(tok)
            slots.append(len(slots) + 1)
            attn = PagedAttention(pool, [RowSpec(list(slots), 1)], native=native)
            hidden = model(torch.tensor([tok]), torch.tensor([len(slots) - 1]), attn)
            logits.append(model.compute_logits(hidden)[0].float())
    return logits, fed


@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
def test_int8_kv_logits_stay_close_to_bfloat16_kv(bf16_model, tokenizer, native):
    """Teacher-forced on the bfloat16 pool's greedy tokens, every step's logits with int8 K/V are
    within MAX_LOGIT_DIFF of bfloat16's and pick the same top-1 token at every step that is not a
    near tie; doubling the K scales (what a wrong scale does) breaks the bound."""
    model = bf16_model.model
    before = model.native_ops
    if not native:
        model.use_native_ops(False)
    elif not model.use_native_ops(True):
        pytest.skip("the native layer ops are not available")
    try:
        ids = tokenizer.encode(PROMPT)
        ref, fed = _decode_logits(model, "auto", ids, None)
        got, _ = _decode_logits(model, "int8", ids, fed)
        diffs = [float((a - b).abs().max()) for a, b in zip(ref, got)]
        assert max(diffs) <= MAX_LOGIT_DIFF, diffs
        # the same top-1 wherever bfloat16's top two are more than NEAR_TIE apart (this prompt has
        # steps whose top two are tied exactly, or one bfloat16 step apart)
        clear = [i for i, a in enumerate(ref) if float(a.topk(2).values[0] - a.topk(2).values[1]) > NEAR_TIE]
        flips = [i for i in clear if int(ref[i].argmax()) != int(got[i].argmax())]
        assert len(clear) >= len(ref) // 2 and not flips, (flips, len(clear))

        def double_k_scales(pool):
            for s in pool.k_scale_layers:
                s.mul_(2)

        bad, _ = _decode_logits(model, "int8", ids, fed, steps=4, corrupt=double_k_scales)
        assert max(float((a - b).abs().max()) for a, b in zip(ref[1:5], bad[1:])) > 2 * MAX_LOGIT_DIFF
    finally:
        model.use_native_ops(before)


def _greedy(n: int = 32) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True, return_logprob=True, top_logprobs_num=5)


def test_int8_kv_greedy_output_matches_bfloat16_kv_for_a_prefix(bf16_model):
    """Through the engine (chunked prefill of a prompt longer than a chunk, then decode): int8 K/V's
    greedy tokens equal bfloat16 K/V's for at least the first 16 of 32."""
    prompt = PROMPT * 4
    outs = {}
    for kv in ("auto", "int8"):
        eng = Engine(model=bf16_model, max_total_tokens=2048, kv_cache_dtype=kv, chunked_prefill_size=64)
        try:
            outs[kv] = eng.generate(prompt, _greedy()).token_ids
        finally:
            eng.shutdown()
    a, b = outs["auto"], outs["int8"]
    same = next((i for i in range(len(a)) if a[i] != b[i]), len(a))
    assert same >= 16, (same, a, b)


def test_int8_kv_radix_reuse_and_forks(bf16_model):
    """An int8 pool shares slots through the radix cache as a bfloat16 one does: a repeated prompt
    is served from cache with the same tokens, and concurrent requests forking one cached prefix
    each match their own run alone."""
    eng = Engine(model=bf16_model, max_total_tokens=4096, kv_cache_dtype="int8")
    try:
        assert eng.pool.quantized and eng.pool.k.dtype == torch.int8
        first = eng.generate(PROMPT, _greedy(16))
        again = eng.generate(PROMPT, _greedy(16))
        assert again.cached_tokens >= first.prompt_tokens - 1
        assert again.token_ids == first.token_ids
        suffixes = [" Consider first", " In Venice", " The consequences"]
        alone = [eng.generate(PROMPT + s, _greedy(16)) for s in suffixes]
        results: list = [None] * len(suffixes)

        def run(i: int) -> None:
            results[i] = eng.generate(PROMPT + suffixes[i], _greedy(16))

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(suffixes))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for a, b in zip(alone, results):
            assert b.cached_tokens > 0
            assert_same_greedy(a, b)
        eng.check_integrity()
    finally:
        eng.shutdown()


def test_kv_cache_dtype_is_checked_before_anything_loads():
    for bad in ("fp8", "INT8", 8, None):
        with pytest.raises(InvalidRequest, match="kv_cache_dtype") as info:
            EngineConfig(kv_cache_dtype=bad)
        assert info.value.field == "kv_cache_dtype"
    with pytest.raises(InvalidRequest, match="compile") as info:
        EngineConfig(kv_cache_dtype="int8", compile=True)
    assert info.value.field == "kv_cache_dtype"
    # (a model that does not exist: the option's error comes first, nothing is loaded)
    with pytest.raises(InvalidRequest, match="kv_cache_dtype"):
        Engine(model="/no/such/model.gguf", kv_cache_dtype="fp16")
