"""Skeleton-of-thought with ``programs/skeleton_of_thought.py``: an outline, then every point
expanded in parallel.

    python examples/skeleton_of_thought_agent.py [--model PATH] [--points 3]

Shows: a ``regex=`` constraint that fixes the outline's shape (exactly N numbered points),
``fork`` over a list computed from a generated value, ``join``, and the prefix cache shared by
the branches.
"""
from __future__ import annotations

import time

from _common import describe, finish, parse_args, start

from programs.skeleton_of_thought import skeleton_of_thought

QUESTION = "How can I get better at running?"


def main() -> None:
    args = parse_args(__doc__.split("\n\n")[0], points=(int, 3, "number of outline points"))
    rt = start(args)
    t0 = time.perf_counter()
    st = skeleton_of_thought.run(question=QUESTION, num_points=args.points, expansion_tokens=40)
    print(f"\nQuestion: {QUESTION}\n\nOutline:\n{st['skeleton']}\n  ({describe(st.get_meta_info('skeleton'))})")
    print("\nAnswer:\n" + st["answer"])
    print("\nBranches:")
    for i, meta in enumerate(st.get_meta_info("expansion")):
        print(f"  point {i + 1}: {describe(meta)}")
    finish(rt, t0)


if __name__ == "__main__":
    main()
