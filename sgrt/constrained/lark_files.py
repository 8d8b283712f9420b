"""The Lark grammars shipped in ``grammars/``, by name (``--grammar json``, ``grammar="json"``).

Apart from the compiler (which imports torch) so that the command line checks a ``--grammar``
argument without it.
"""
from __future__ import annotations

import re
from pathlib import Path

from sgrt.errors import GrammarError

GRAMMARS_DIR = Path(__file__).resolve().parents[2] / "grammars"
_GRAMMAR_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")


def grammar_files() -> list[str]:
    """Names of the grammars shipped in ``grammars/`` (``["arithmetic", "json", ...]``)."""
    return sorted(p.stem for p in GRAMMARS_DIR.glob("*.lark"))


def load_grammar_text(grammar: str) -> str:
    """``grammar`` itself if it is Lark text, else the text of ``grammars/<name>[.lark]``.

    Raises:
        GrammarError: (field ``grammar``) a bare name with no such file.
    """
    if not _GRAMMAR_NAME.match(grammar.strip()):
        return grammar
    name = grammar.strip()
    stem = name[:-5] if name.endswith(".lark") else name
    path = GRAMMARS_DIR / f"{stem}.lark"
    if not path.is_file():
        raise GrammarError(f"no grammar file {name!r} in grammars/ (have: {', '.join(grammar_files())})", field="grammar")
    return path.read_text(encoding="utf-8")
