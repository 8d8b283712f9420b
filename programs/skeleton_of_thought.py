"""``skeleton_of_thought``: write an outline, expand its points in parallel, join them.

After Ning et al., "Skeleton-of-Thought" (arXiv:2307.15337). The outline is generated under a
regex that admits exactly ``num_points`` numbered lines, so it always parses into that many
points. ``s.fork(num_points)`` then expands every point at once: the branches share the
conversation so far through the prefix cache (committed once before they start) and are batched
together by the engine. ``join()`` gathers the expansions back into the parent.

Over the session server::

    {"type": "session.start", "session": "k1", "program": "skeleton_of_thought",
     "args": {"question": "How do I learn to cook?", "num_points": 3}}
"""
from __future__ import annotations

import re

import sgrt


def outline_regex(num_points: int, max_chars: int) -> str:
    """``1. <point>`` ... ``N. <point>``, one per line; a point is a letter then 2 to
    ``max_chars - 1`` characters other than a newline."""
    return "\n".join(rf"{i}\. [A-Za-z][^\n]{{2,{max_chars - 1}}}" for i in range(1, num_points + 1))


def parse_outline(text: str) -> list[str]:
    """The points of an outline written as ``1. ...`` lines."""
    return [m.strip() for m in re.findall(r"^\d+\. (.*)$", text, flags=re.M)]


@sgrt.function
def skeleton_of_thought(s, question: str, num_points: int = 3, point_chars: int = 50, expansion_tokens: int = 40):
    """Answer ``question`` as an outline of ``num_points`` points, each expanded in parallel.

    Inputs:
        question: what to answer.
        num_points: how many outline points (1 to 9).
        point_chars: the most characters of one outline point.
        expansion_tokens: the most tokens of each point's expansion.

    Variables:
        ``skeleton``: the outline text (matches :func:`outline_regex`); ``points``: its points;
        ``expansion``: the list of expansions, one per point (per-branch meta info has
        ``cached_tokens``); ``answer``: the points with their expansions, one paragraph each.

    Shows: a regex constraint that fixes a structure, ``fork`` over a list computed from a
    generated value, ``join``.

    Raises:
        ValueError: ``num_points`` outside 1..9.
    """
    if not 1 <= num_points <= 9:
        raise ValueError(f"num_points must be in 1..9, got {num_points}")
    s += sgrt.system("You are a helpful assistant. You answer with a short outline first.")
    s += sgrt.user(question + "\nGive an outline of " + str(num_points)
                   + " numbered points, a few words each.")
    s += sgrt.assistant(sgrt.gen("skeleton", regex=outline_regex(num_points, point_chars),
                                 max_tokens=num_points * (point_chars // 2 + 4)))
    points = parse_outline(s["skeleton"])
    s["points"] = points
    if not points:  # NOTE: only an outline cut short before its first point
        s["expansion"], s["answer"] = [], ""
        return
    forks = s.fork(len(points))
    forks += lambda i: (sgrt.user("Explain this point in one or two sentences: " + points[i])
                        + sgrt.assistant(sgrt.gen("expansion", max_tokens=expansion_tokens)))
    forks.join()
    s["answer"] = "\n\n".join(f"{i + 1}. {p}\n{e.strip()}" for i, (p, e) in enumerate(zip(points, s["expansion"])))
