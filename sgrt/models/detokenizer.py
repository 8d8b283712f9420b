"""Streaming detokenization: turn token ids into text as they arrive, one complete piece at a time.

Decoding each new token on its own is wrong twice over: a multi-byte character split across
tokens decodes to U+FFFD halves, and some tokenizers (SentencePiece's leading-space rule, byte-level
merges) decode a suffix differently from how that suffix reads inside the whole. So we keep two
offsets into the id list, as vLLM, TGI and tokenizers' ``DecodeStream`` do:

- ``prefix_offset``: start of a short window of already-emitted tokens kept as left context;
- ``read_offset``: end of what has been emitted.

Each step decodes the window ``ids[prefix_offset:]`` once and compares it with the cached text of
``ids[prefix_offset:read_offset]`` (the window's emitted part); the new text is the difference.
While that text ends in U+FFFD the tail is an incomplete character and is held back. When text is
emitted, the window's decode *is* the next step's cached prefix text, so a step costs one decode
of a few tokens. The window grows by the emitted tokens until it holds more than
:data:`MAX_WINDOW` tokens; then it restarts at the last emitted chunk (one extra decode then).
"""
from __future__ import annotations

from collections.abc import Iterable

from sgrt.models.tokenizer import Tokenizer

REPLACEMENT_CHAR = "\ufffd"
# Tokens in the decode window before it restarts: long enough that the restart's extra decode is
# rare, short enough that decoding the window stays a few microseconds.
MAX_WINDOW = 8


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
        self._decode = tokenizer.decode
        self._prefix_text = ""  # decode of ids[prefix_offset:read_offset]

    def add(self, token_ids: int | Iterable[int]) -> str:
        """Append one id or several; return the newly completed text (possibly ``""``)."""
        if isinstance(token_ids, int):
            self.ids.append(token_ids)
        else:
            self.ids.extend(int(t) for t in token_ids)
        if len(self.ids) == self.read_offset:
            return ""
        prefix_text = self._prefix_text
        full_text = self._decode(self.ids[self.prefix_offset:], self.skip_special_tokens)
        if len(full_text) > len(prefix_text) and not full_text.endswith(REPLACEMENT_CHAR):
            self._advance(full_text)
            return full_text[len(prefix_text):]
        return ""

    def flush(self) -> str:
        """Return whatever is held back (an unfinished character decodes to U+FFFD).

        Call at the end of the stream; ``add`` may still be called afterwards.
        """
        if len(self.ids) == self.read_offset:
            return ""
        prefix_text = self._prefix_text
        full_text = self._decode(self.ids[self.prefix_offset:], self.skip_special_tokens)
        self._advance(full_text)
        return full_text[len(prefix_text):]

    @property
    def text_pending(self) -> bool:
        """True while tokens have been added whose text has not been returned yet."""
        return len(self.ids) > self.read_offset

    def _advance(self, full_text: str) -> None:
        """Mark everything added as emitted; ``full_text`` is the decode of the whole window."""
        last_read = self.read_offset
        self.read_offset = len(self.ids)
        if self.read_offset - self.prefix_offset <= MAX_WINDOW:
            self._prefix_text = full_text
            return
        # NOTE: the new window starts at the old read offset, which sits on a character boundary
        # (it only advances when the text was complete, or at flush).
        self.prefix_offset = last_read
        self._prefix_text = self._decode(self.ids[last_read:], self.skip_special_tokens)
