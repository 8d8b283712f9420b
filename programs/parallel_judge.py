"""``parallel_judge``: sample N candidate answers in parallel, then let the model pick the best.

``s.fork(n)`` commits the shared prompt to the prefix cache once (a prefill-only request), then
the N branches run concurrently and are batched together by the engine; each prefills only its
own tokens. Each branch samples with its own seed, so the candidates differ. The judge then
continues the same conversation (whose prompt is cached) and ``select``s a candidate number:
the choice is scored from log-probabilities, so it is always a valid index.

Over the session server::

    {"type": "session.start", "session": "j1", "program": "parallel_judge",
     "args": {"question": "Why is the sky blue?", "n": 3}}
"""
from __future__ import annotations

import sgrt

DEFAULT_SYSTEM = "You are a helpful assistant. Answer in one or two sentences."


@sgrt.function
def parallel_judge(s, question: str, n: int = 3, context: str = "", temperature: float = 0.8, seed: int = 0,
                   max_tokens: int = 48, system: str = DEFAULT_SYSTEM):
    """Answer ``question`` ``n`` times in parallel and choose the best answer.

    Inputs:
        question: the question.
        n: how many candidates (2 to 9).
        context: optional text the question is about (put before the question).
        temperature, seed: how each candidate samples; candidate ``i`` uses ``seed + i``.
        max_tokens: the most tokens of each candidate.
        system: the system prompt.

    Variables:
        ``candidate``: the list of the ``n`` candidate answers (one per branch; meta info per
        branch has ``cached_tokens``); ``best``: the chosen number, ``"1"`` .. ``str(n)``
        (meta info: per-option ``normalized_prompt_logprobs``); ``answer``: the chosen
        candidate.

    Shows: ``fork`` / ``join`` with a shared cached prefix, sampling with per-branch seeds,
    ``select`` as a judge.

    Raises:
        ValueError: ``n`` outside 2..9.
    """
    if not 2 <= n <= 9:
        raise ValueError(f"n must be in 2..9, got {n}")
    s += sgrt.system(system)
    s += sgrt.user(("Text:\n" + context + "\n\nQuestion: " if context else "") + question)
    forks = s.fork(n)
    forks += lambda i: sgrt.assistant(sgrt.gen("candidate", max_tokens=max_tokens, temperature=temperature,
                                               seed=seed + i))
    forks.join()
    candidates = s["candidate"]
    listing = "\n".join(f"Answer {i + 1}: {c.strip()}" for i, c in enumerate(candidates))
    s += sgrt.user("Here are " + str(n) + " candidate answers to the question.\n" + listing
                   + "\nWhich answer is the most accurate and helpful? Reply with its number.")
    s += sgrt.assistant("The best answer is Answer " + sgrt.select("best", [str(i + 1) for i in range(n)]))
    s["answer"] = candidates[int(s["best"]) - 1]
