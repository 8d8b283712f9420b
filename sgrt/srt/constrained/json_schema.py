"""``sglang.srt.constrained.json_schema``'s helper (older SGLang): :func:`build_regex_from_object`."""
from sgrt.srt.constrained import build_regex_from_object

__all__ = ["build_regex_from_object"]
