"""sgrt showcase on the embedded default model: answer a question and print TTFT and tok/s.

Run: ``make demo`` (or ``python examples/showcase.py``).
"""
from __future__ import annotations

import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from sgrt.engine import Engine, SamplingParams  # noqa: E402


def main() -> int:
    t0 = time.perf_counter()
    engine = Engine()
    print(f"loaded the default model in {time.perf_counter() - t0:.1f} s")
    question = "What is the capital of France, and what river runs through it?"
    prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": question}])
    print(f"Q: {question}\nA: ", end="", flush=True)
    result = None
    for chunk in engine.stream(prompt, SamplingParams(max_tokens=64)):
        print(chunk.text, end="", flush=True)
        result = chunk.result
    print()
    print(f"TTFT {1000 * result.ttft:.0f} ms, {result.output_tok_per_s:.1f} tok/s, "
          f"{result.completion_tokens} tokens ({result.finish_reason})")
    engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
