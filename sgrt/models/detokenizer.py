"""Streaming detokenization: turn token ids into text as they arrive, one complete piece at a time.

Decoding each new token on its own is wrong twice over: a multi-byte character split across
tokens decodes to U+FFFD halves, and some tokenizers (SentencePiece's leading-space rule, byte-level
merges) decode a suffix differently from how that suffix reads inside the whole. So we keep two
offsets into the id list, as vLLM and TGI do:

- ``prefix_offset``: start of a short window of already-emitted tokens kept as left context;
- ``read_offset``: end of what has been emitted.

Each step decodes ``ids[prefix_offset:read_offset]`` (text already emitted, in context) and
``ids[prefix_offset:]`` (the same plus the new tokens); the new text is the difference. While that
text ends in U+FFFD the tail is an incomplete character and is held back.
"""
from __future__ import annotations

from collections.abc import Iterable

from sgrt.models.tokenizer import Tokenizer

REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Converts a stream of token ids into a stream of text chunks.

    The concatenation of every ``add`` return value and the final ``flush`` equals
    ``tokenizer.decode(all_ids, skip_special_tokens)``, and no chunk before ``flush`` ends in a
    partial character (``flush`` may return U+FFFD if the stream itself ends mid-character).

    Not thread-safe: one instance per request.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        """``tokenizer``: an :class:`sgrt.models.Tokenizer` (anything with ``decode(ids, skip)``)."""
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0

    def add(self, token_ids: int | Iterable[int]) -> str:
        """Append one id or several; return the newly completed text (possibly ``""``)."""
        if isinstance(token_ids, int):
            self.ids.append(token_ids)
        else:
            self.ids.extend(int(t) for t in token_ids)
        if len(self.ids) == self.read_offset:
            return ""
        prefix_text, full_text = self._window_texts()
        if len(full_text) > len(prefix_text) and not full_text.endswith(REPLACEMENT_CHAR):
            # NOTE: the new start of the context window is the old read offset, which always sits
            # on a character boundary (we only advance it when the text was complete).
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            return full_text[len(prefix_text):]
        return ""

    def flush(self) -> str:
        """Return whatever is held back (an unfinished character decodes to U+FFFD).

        Call at the end of the stream; ``add`` may still be called afterwards.
        """
        if len(self.ids) == self.read_offset:
            return ""
        prefix_text, full_text = self._window_texts()
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        return full_text[len(prefix_text):]

    @property
    def text_pending(self) -> bool:
        """True while tokens have been added whose text has not been returned yet."""
        return len(self.ids) > self.read_offset

    def _window_texts(self) -> tuple[str, str]:
        decode = self.tokenizer.decode
        prefix_text = decode(self.ids[self.prefix_offset:self.read_offset], self.skip_special_tokens)
        full_text = decode(self.ids[self.prefix_offset:], self.skip_special_tokens)
        return prefix_text, full_text
