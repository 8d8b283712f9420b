"""``sglang.srt.utils`` paths programs import from (see :mod:`sgrt.srt`)."""
