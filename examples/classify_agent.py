"""Few-shot sentiment classification with ``programs/classify.py`` over a batch of reviews.

    python examples/classify_agent.py [--model PATH]

Shows: ``select`` (every label is scored by its log-probability, so the answer is always a
label, with a confidence), and prefix hinting: ``run_batch`` puts the shared few-shot block
into the prefix cache once, and every item prefills only its own text.
"""
from __future__ import annotations

import math
import time

from _common import finish, parse_args, start

from programs.classify import DEFAULT_EXAMPLES, DEFAULT_INSTRUCTION, DEFAULT_LABELS, classify

REVIEWS = [
    "Absolutely loved it, would buy again.",
    "It broke after two days and support never replied.",
    "The package contains one cable and a manual.",
    "Great value for the price, the kids adore it.",
    "Terrible smell, I returned it the same day.",
    "Delivery is expected between Monday and Wednesday.",
]


def main() -> None:
    args = parse_args(__doc__.split("\n\n")[0])
    rt = start(args)
    t0 = time.perf_counter()
    # NOTE: bound, not left at their defaults: run_batch finds the shared prefix by tracing the
    # program, and tracing treats arguments it is not given as unknown.
    program = classify.bind(labels=DEFAULT_LABELS, examples=DEFAULT_EXAMPLES, instruction=DEFAULT_INSTRUCTION)
    states = program.run_batch([{"text": r} for r in REVIEWS])
    print()
    for review, st in zip(REVIEWS, states):
        meta = st.get_meta_info("label")
        probs = [math.exp(x) for x in meta["normalized_prompt_logprobs"]]
        conf = probs[meta["choices"].index(st["label"])] / sum(probs)
        cached = min(meta["cached_tokens"])
        print(f"{st['label']:>8} ({conf:.0%})  {review}   [{cached}/{meta['prompt_tokens'][0]} tokens cached]")
    finish(rt, t0)


if __name__ == "__main__":
    main()
