"""A ReAct agent with two Python tools, using ``programs/react.py``.

    python examples/react_agent.py [--model PATH] [--max-steps 3]

Shows: a Python loop over generated values (thought, then an action as JSON under a union of
per-tool schemas, then the tool's observation); tools are plain Python callables that run
here; the last allowed step admits only ``finish``, so the loop ends within ``--max-steps``.
The 135M default model picks tools poorly: the grammar guarantees the shape, not the wisdom.
"""
from __future__ import annotations

import time

from _common import finish, parse_args, start

from programs.react import calculator, make_search, react

NOTES = """\
The Eiffel Tower in Paris is about 330 metres tall and was finished in 1889.
The Great Wall of China is more than 21000 kilometres long.
A marathon is 42.195 kilometres long."""
QUESTIONS = ["How tall is the Eiffel Tower in feet?", "What is 365 * 24?"]


def main() -> None:
    args = parse_args(__doc__.split("\n\n")[0], max_steps=(int, 3, "most actions per question"))
    rt = start(args)
    t0 = time.perf_counter()
    tools = {"search": make_search(NOTES), "calculator": calculator}
    for q in QUESTIONS:
        st = react.run(question=q, tools=tools, max_steps=args.max_steps)
        print(f"\nQuestion: {q}")
        obs = iter(st["observations"])
        for i, action in enumerate(st["actions"]):
            print(f"  Thought {i + 1}: {st[f'thought_{i}'].strip()}")
            print(f"  Action {i + 1}: {action['tool']}({action['input']!r})")
            if action["tool"] != "finish":
                print(f"  Observation {i + 1}: {next(obs)}")
        print(f"Answer: {st['answer']}  ({st['steps']} of at most {args.max_steps} steps)")
    finish(rt, t0)


if __name__ == "__main__":
    main()
