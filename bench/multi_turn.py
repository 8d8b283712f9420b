"""Multi-turn chat: per-turn TTFT of a 10-turn conversation with the radix cache on and off.

Each turn re-sends the whole conversation (as a chat client does) and generates 32 tokens.
With the cache, each turn prefills only its new tokens. Targets: with the cache, turn-10 TTFT
<= 1.5x turn-2 TTFT, and turn-10 TTFT >= 3x lower than without the cache.

Run: ``python bench/multi_turn.py``
"""
from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.common import emit_json, print_table  # noqa: E402
from bench.workloads import filler  # noqa: E402


def conversation_ttfts(loaded, cache: bool, turns: int, answer_tokens: int) -> list[float]:
    from sgrt.engine import Engine, SamplingParams

    engine = Engine(model=loaded, max_total_tokens=16384, enable_radix_cache=cache)
    rng = random.Random(3)
    messages = [{"role": "system", "content": "You are a helpful assistant. " + filler(rng, 60)}]
    ttfts = []
    try:
        for turn in range(turns):
            messages.append({"role": "user", "content": f"Turn {turn + 1}: " + filler(rng, 25)})
            prompt = engine.tokenizer.apply_chat_template(messages)
            r = engine.generate(prompt, SamplingParams(max_tokens=answer_tokens, ignore_eos=True))
            ttfts.append(r.ttft)
            messages.append({"role": "assistant", "content": r.text})
        return ttfts
    finally:
        engine.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--answer-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from sgrt.models import load_model

    loaded = load_model("smollm2-135m-instruct", dtype="float32")
    conversation_ttfts(loaded, True, 2, 4)  # warm-up
    on = conversation_ttfts(loaded, True, args.turns, args.answer_tokens)
    off = conversation_ttfts(loaded, False, args.turns, args.answer_tokens)
    rows = [[i + 1, 1000 * a, 1000 * b] for i, (a, b) in enumerate(zip(on, off))]
    print_table(["turn", "TTFT ms (cache)", "TTFT ms (no cache)"], rows)
    growth = on[-1] / on[1]
    gain = off[-1] / on[-1]
    print(f"cache: last/turn-2 TTFT = {growth:.2f}x (target <= 1.5x); no-cache/cache at the last turn = {gain:.2f}x (target >= 3x)")
    emit_json("multi_turn", turns=args.turns, ttft_ms_cache=[round(1000 * t, 1) for t in on],
              ttft_ms_no_cache=[round(1000 * t, 1) for t in off], last_over_turn2=round(growth, 3),
              no_cache_over_cache=round(gain, 3))


if __name__ == "__main__":
    main()
