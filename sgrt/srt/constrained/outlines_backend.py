"""``sglang.srt.constrained.outlines_backend``'s helper: :func:`build_regex_from_object`."""
from sgrt.srt.constrained import build_regex_from_object

__all__ = ["build_regex_from_object"]
