"""A three-turn conversation with ``programs/chat.py``; each turn reuses the last from the cache.

    python examples/chat_agent.py [--model PATH] [--turns "Hi!" "And then?"]

Shows: roles and the model's chat template; how many prompt tokens of each turn came from the
radix cache (all of the previous turns: only the new message is prefilled).
"""
from __future__ import annotations

import time

from _common import describe, finish, parse_args, start

from programs.chat import chat

TURNS = ["Hi! What can you help me with?", "Give me one tip for learning to cook.",
         "Thanks! Say goodbye in one sentence."]


def main() -> None:
    args = parse_args(__doc__.split("\n\n")[0], max_tokens=(int, 40, "tokens per reply"))
    rt = start(args)
    t0 = time.perf_counter()
    st = chat.run(turns=TURNS, max_tokens=args.max_tokens)
    for i, turn in enumerate(TURNS):
        print(f"\nuser> {turn}\nassistant> {st[f'reply_{i}'].strip()}")
        print(f"  ({describe(st.get_meta_info(f'reply_{i}'))})")
    finish(rt, t0)


if __name__ == "__main__":
    main()
