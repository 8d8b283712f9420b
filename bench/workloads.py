"""Seeded synthetic prompts for the benchmarks (no data files, no network)."""
from __future__ import annotations

import random

WORDS = (
    "river mountain engine garden market letter window morning winter station harbour signal "
    "library machine question answer village forest bridge candle silver ocean number story "
    "teacher student kitchen paper pattern travel journey weather history science music"
).split()


def filler(rng: random.Random, n_words: int) -> str:
    """Plausible-looking sentences of ``n_words`` words."""
    words = []
    while len(words) < n_words:
        k = rng.randint(6, 14)
        sentence = [rng.choice(WORDS) for _ in range(k)]
        sentence[0] = sentence[0].capitalize()
        words.extend(sentence[:-1] + [sentence[-1] + "."])
    return " ".join(words[:n_words])


def prompt_of_tokens(tokenizer, rng: random.Random, n_tokens: int, prefix: str = "") -> str:
    """A chat prompt whose token count is close to ``n_tokens`` (within a few tokens)."""
    n_words = max(1, int(n_tokens * 0.75))
    while True:
        body = prefix + filler(rng, n_words) + "\nSummarise the text above."
        text = tokenizer.apply_chat_template([{"role": "user", "content": body}])
        have = len(tokenizer.encode(text))
        if have >= n_tokens or n_words > 4 * n_tokens:
            return text
        n_words += max(1, (n_tokens - have) // 2)
