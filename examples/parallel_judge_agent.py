"""Best-of-N with ``programs/parallel_judge.py``: fork three sampled answers, let the model judge.

    python examples/parallel_judge_agent.py [--model PATH] [--n 3]

Shows: ``fork`` (the question is prefilled once, the branches run as one batch), per-branch
seeds (different candidates, reproducible), and ``select`` as a judge with its scores.
"""
from __future__ import annotations

import math
import time

from _common import describe, finish, parse_args, start

from programs.parallel_judge import parallel_judge

QUESTION = "Why do we have seasons on Earth?"


def main() -> None:
    args = parse_args(__doc__.split("\n\n")[0], n=(int, 3, "number of candidates"))
    rt = start(args)
    t0 = time.perf_counter()
    st = parallel_judge.run(question=QUESTION, n=args.n, max_tokens=40)
    print(f"\nQuestion: {QUESTION}")
    scores = st.get_meta_info("best")["normalized_prompt_logprobs"]
    total = sum(math.exp(x) for x in scores)
    for i, (cand, meta) in enumerate(zip(st["candidate"], st.get_meta_info("candidate"))):
        mark = "*" if str(i + 1) == st["best"] else " "
        print(f"{mark} Answer {i + 1} (judge {math.exp(scores[i]) / total:.0%}): {cand.strip()}")
        print(f"    ({describe(meta)})")
    print(f"\nChosen: Answer {st['best']}")
    finish(rt, t0)


if __name__ == "__main__":
    main()
