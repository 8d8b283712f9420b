"""sgrt showcase on the embedded default model (``make demo``).

1. Answers a question, streaming, and prints TTFT and tok/s.
2. Reads a public-domain passage (the opening of *Pride and Prejudice*, Project Gutenberg
   eBook #1342, in ``examples/data/``) and, in one program over one conversation:
   extracts facts as JSON under a JSON Schema, forks three sampled answers to a question about
   it, and lets the model ``select`` the best one.
3. Prints the JSON, the candidates and the chosen answer, and a metrics table: per generation
   (TTFT, tok/s, prompt tokens served from the prefix cache, forced jump-forward tokens) from
   each gen's meta info, and for the whole run from ``Engine.stats()`` (cache hit rate, forced
   tokens, speculative acceptance with the n-gram drafter, throughput).

Run: ``make demo``, or ``python examples/showcase.py [--model PATH] [--dtype bfloat16]``.
"""
from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

from _common import parse_args

import sgrt
from sgrt.lang import ProgramState

PASSAGE = (Path(__file__).parent / "data" / "pride_and_prejudice_ch1.txt").read_text(encoding="utf-8")

#: What to extract from the passage. Every string is bounded, so the reply always completes.
FACTS = {
    "type": "object",
    "properties": {
        "tenant_name": {"type": "string", "maxLength": 30},
        "house": {"type": "string", "maxLength": 30},
        "arrival_day": {"enum": ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]},
        "is_married": {"type": "boolean"},
        "yearly_income": {"type": "string", "maxLength": 40},
        "who_told_mrs_bennet": {"type": "string", "maxLength": 30},
    },
    "required": ["tenant_name", "house", "arrival_day", "is_married", "yearly_income", "who_told_mrs_bennet"],
}
QUESTION = "Why is Mrs. Bennet so excited about the new tenant of Netherfield?"


@sgrt.function
def qa(s, question):
    """Answer ``question`` (variable ``answer``, at most 64 tokens)."""
    s += sgrt.user(question)
    s += sgrt.assistant(sgrt.gen("answer", max_tokens=64))


@sgrt.function
def study(s, passage, question, n=3):
    """Extract facts from ``passage`` as JSON, then answer ``question`` n ways and pick the best."""
    s += sgrt.user("Passage:\n" + passage + "\n\nList the facts from the passage as JSON.")
    s += sgrt.assistant(sgrt.gen("facts", json_schema=FACTS, max_tokens=160))
    s += sgrt.user(question + " Answer in one sentence.")
    forks = s.fork(n)  # the passage and the facts are prefilled once, shared by every branch
    forks += lambda i: sgrt.assistant(sgrt.gen("candidate", max_tokens=40, temperature=0.7, seed=i))
    forks.join()
    listing = "\n".join(f"Answer {i + 1}: {c.strip()}" for i, c in enumerate(s["candidate"]))
    s += sgrt.user("Which answer is the most accurate?\n" + listing)
    s += sgrt.assistant("The most accurate is Answer " + sgrt.select("best", [str(i + 1) for i in range(n)]))


def tok_per_s(meta: dict) -> float | None:
    """Decode speed of one generation: tokens after the first over the time after the first."""
    n, ttft, e2e = meta["completion_tokens"], meta.get("ttft"), meta.get("e2e_latency")
    if n < 2 or ttft is None or not e2e or e2e <= ttft:
        return None
    return (n - 1) / (e2e - ttft)


def row(name: str, meta: dict) -> str:
    """One line of the metrics table from a gen's meta info."""
    speed = tok_per_s(meta)
    hit = meta["cached_tokens"] / meta["prompt_tokens"] if meta["prompt_tokens"] else 0.0
    return (f"{name:<14} {meta['completion_tokens']:>6} {1000 * (meta.get('ttft') or 0):>8.0f} "
            f"{(f'{speed:.1f}' if speed else '-'):>7} {meta['prompt_tokens']:>7} {meta['cached_tokens']:>7} "
            f"{hit:>6.0%} {meta.get('forced_tokens', 0):>7}")


def main() -> int:
    args = parse_args(__doc__.split("\n\n")[0])
    t0 = time.perf_counter()
    with sgrt.Runtime(model=args.model, dtype=args.dtype, speculative="ngram") as rt:
        sgrt.set_default_backend(rt)
        print(f"loaded {args.model} ({args.dtype}) in {time.perf_counter() - t0:.1f} s")
        demo(rt)
    print(f"whole run {time.perf_counter() - t0:.1f} s")
    return 0


def demo(rt: sgrt.Runtime) -> tuple[ProgramState, ProgramState]:
    """The three parts, on ``rt`` (the default backend); returns the two programs' states."""
    # 1. A question, streamed.
    question = "What is the capital of France, and what river runs through it?"
    print(f"\nQ: {question}\nA: ", end="", flush=True)
    answer_state = st = qa.run(question=question, stream=True)
    for piece in st.text_iter("answer"):
        print(piece, end="", flush=True)
    meta = st.get_meta_info("answer")
    speed = tok_per_s(meta)
    print(f"\n[TTFT {1000 * meta['ttft']:.0f} ms, {speed or 0:.1f} tok/s, {meta['completion_tokens']} tokens, "
          f"{meta['finish_reason']['type']}]")

    # 2. Extraction, fork and select over the passage.
    t1 = time.perf_counter()
    print(f"\nPassage: Pride and Prejudice, chapter 1 "
          f"({len(PASSAGE.split())} words, {rt.count_tokens(PASSAGE)} tokens)")
    st = study.run(passage=PASSAGE, question=QUESTION, n=3)
    facts_meta = st.get_meta_info("facts")
    if facts_meta["incomplete"]:  # NOTE: max_tokens cut it short; the schema bounds every string, so rare
        print("\nFacts (JSON under a schema, cut short by max_tokens):\n" + st["facts"])
    else:
        print("\nFacts (JSON under a schema):\n" + json.dumps(json.loads(st["facts"]), indent=2))
    print(f"\nQ: {QUESTION}")
    scores = st.get_meta_info("best")["normalized_prompt_logprobs"]
    total = sum(math.exp(x) for x in scores)
    for i, cand in enumerate(st["candidate"]):
        mark = "*" if st["best"] == str(i + 1) else " "
        print(f" {mark} {i + 1}. ({math.exp(scores[i]) / total:.0%}) {' '.join(cand.split())}")
    print(f"Chosen answer: {' '.join(st['candidate'][int(st['best']) - 1].split())}")
    elapsed = time.perf_counter() - t1

    # 3. Metrics.
    print(f"\n{'generation':<14} {'tokens':>6} {'TTFT ms':>8} {'tok/s':>7} {'prompt':>7} {'cached':>7} "
          f"{'hit':>6} {'forced':>7}")
    print(row("answer", meta))
    print(row("facts (JSON)", st.get_meta_info("facts")))
    for i, m in enumerate(st.get_meta_info("candidate")):
        print(row(f"candidate {i + 1}", m))
    judge = st.get_meta_info("best")  # select: one prefill-only scoring request per option
    print(row("judge (select)", {"completion_tokens": 0, "prompt_tokens": sum(judge["prompt_tokens"]),
                                 "cached_tokens": sum(judge["cached_tokens"])}))
    stats = rt.engine.stats()
    print(f"\nengine: cache hit rate {stats['cache_hit_rate']:.0%} ({stats['cached_tokens']}/{stats['prompt_tokens']} "
          f"prompt tokens), forced (jump-forward) tokens {stats['forced_tokens']}, speculative acceptance "
          f"{stats['spec_acceptance_rate']:.0%} ({stats['spec_accepted']}/{stats['spec_drafted']} n-gram draft "
          f"tokens), {stats['generated_tokens']} tokens generated in {stats['steps']} steps "
          f"({stats['throughput_tok_s']:.1f} tok/s since the first request)")
    print(f"passage program: {elapsed:.1f} s")
    return answer_state, st


if __name__ == "__main__":
    sys.exit(main())
